"""The whole-stack decode kernel (models/llama/decode_step.py) against the layer-by-layer path it
replaces, on tiny random checkpoints: float weights, INT4 and INT8 weights, float and int8
activations, float32 and int8 KV caches, batches of several sequences, a sliding window, qkv bias,
GQA / MHA / MQA, Qwen 3's q/k norms, and Gemma 3 (four (1 + weight) norms a layer, q/k norms,
GELU-tanh, local and global layers with their own RoPE bases, windows and block tables)."""

import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.models.llama.decode_step import LlamaDecodeStep
from tests.utils import TINY_CONFIGS, build_checkpoint

PROMPTS = [
    {"prompt_token_ids": [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45, 18, 260, 7, 150]},
    {"prompt_token_ids": [1, 40, 41, 42]},
    {"prompt_token_ids": [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]},
]
LONG_PROMPT = {"prompt_token_ids": [(7 * i) % 300 + 1 for i in range(300)]}  # past 256 positions: split attention
# Every width a multiple of 32, so INT4 / INT8 layers run their kernels unpadded (as real checkpoints do).
WIDTHS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
QUANTIZABLE = {
    "llama": ("LlamaConfig", WIDTHS),
    "gemma3": ("Gemma3TextConfig", TINY_CONFIGS["gemma3"][1] | WIDTHS),
}


@pytest.fixture(scope="module", params=list(QUANTIZABLE))
def quantizable_checkpoint(request, tmp_path_factory):
    return build_checkpoint(*QUANTIZABLE[request.param], tmp_path_factory.mktemp(f"tiny_{request.param}_q"))


def run(llm: LLM, fused: bool, prompts: list[dict], steps: int = 24):
    """Greedy outputs with every step's full log-distribution, and how many steps took the fused kernel."""
    body = llm.engine.model.model
    body.fused_decode = fused
    calls = 0
    step = body.decode_step()
    original = type(step).__call__ if step is not None else None

    def counting(self, *args):
        nonlocal calls
        calls += 1
        return original(self, *args)

    vocab = llm.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=vocab)
    if original is not None:
        type(step).__call__ = counting
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        if original is not None:
            type(step).__call__ = original
        body.fused_decode = True
    dists = [torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in o.outputs[0].logprobs]) for o in outputs]
    return [o.outputs[0].token_ids for o in outputs], dists, calls


def assert_matches_layered(llm: LLM, atol: float, prompts=PROMPTS, near_tie: float = 0.0) -> None:
    """Every step's distribution within atol and the same greedy tokens — or, with near_tie, the same
    up to a step where the layered path's top-2 margin is below near_tie."""
    fused_tokens, fused_dists, calls = run(llm, True, prompts)
    layered_tokens, layered_dists, layered_calls = run(llm, False, prompts)
    assert calls > 0 and layered_calls == 0
    for ours, theirs, ours_dist, theirs_dist in zip(fused_tokens, layered_tokens, fused_dists, layered_dists):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        if same < len(ours):
            margin = theirs_dist[same].topk(2).values
            assert margin[0] - margin[1] < near_tie, f"diverged at step {same}, top-2 margin {margin[0] - margin[1]}"
        torch.testing.assert_close(ours_dist[: same + 1], theirs_dist[: same + 1], atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha", "llama_mqa", "llama3_rope", "mistral_window", "qwen2", "qwen3",
                                  "gemma3"])
def test_float_model_matches_layer_by_layer(tiny_checkpoint, name):
    """Float32 weights: the same math as the per-op path, to float32 rounding; alone and batched. The
    body's final norm runs in the step too (Gemma's 1 + weight, Llama's weight)."""
    llm = LLM(str(tiny_checkpoint(name)), progress=False)
    assert llm.engine.model.model.decode_step().final_norm is not None
    assert_matches_layered(llm, atol=2e-5)
    assert_matches_layered(llm, atol=2e-5, prompts=PROMPTS[:1])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_a_mixture_of_experts_matches_layer_by_layer(tiny_checkpoint, threads, name):
    """Qwen3-MoE's experts in the step: the router's softmax top-3 of 8, renormalized, each expert that
    got rows run once on them (SwiGLU, then its down projection, weighted, added into each row's residual)
    — the layered path's `layers/moe.py` to float32 rounding, alone and batched (three rows sharing some
    experts), on 1 to 3 threads. gpt-oss's too: a biased router, biased experts with the clamped SwiGLU
    (cutting in), sinks in every layer's attention and windows on every other layer."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(str(tiny_checkpoint(name)), progress=False)
        assert llm.engine.model.model.decode_step() is not None
        assert_matches_layered(llm, atol=2e-5, prompts=PROMPTS[:1])
        assert_matches_layered(llm, atol=2e-5, prompts=PROMPTS)
        assert_matches_layered(llm, atol=2e-5, prompts=[LONG_PROMPT, PROMPTS[1]])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa"])
def test_long_contexts_split_attention_over_the_threads(tiny_checkpoint, name, threads):
    """Past 256 positions, KV heads that do not share out over the threads (1 or 2 heads on 2 or 3
    threads) split their positions, one part per thread, merged by their softmax maxima and sums:
    the layer-by-layer path's attention to float32 rounding."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(str(tiny_checkpoint(name)), progress=False)
        assert_matches_layered(llm, atol=2e-5, prompts=[LONG_PROMPT])
        assert_matches_layered(llm, atol=2e-5, prompts=[LONG_PROMPT, PROMPTS[1]])  # one split, one too short
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_model_matches_layer_by_layer(quantizable_checkpoint, quantization):
    """INT4 / INT8 weights with float activations: the same row kernels as the per-op path; a batch
    of more than MAX_ROWS sequences goes through them MAX_ROWS rows at a time, as the per-op path does."""
    llm = LLM(str(quantizable_checkpoint), quantization=quantization, activation_quantization=None, progress=False)
    assert llm.engine.model.model.decode_step() is not None
    assert_matches_layered(llm, atol=2e-5)
    assert_matches_layered(llm, atol=2e-5, prompts=(PROMPTS * 4)[:11])  # 11 rows: a run of 8, then 3


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_activations_as_close_to_exact_as_layer_by_layer(quantizable_checkpoint, quantization, activations):
    """Quantized activation blocks run the same integer-dot kernels, but the fused norm and SiLU round
    in the last bit differently from PyTorch's, and a last-bit change moves some activations across a
    rounding boundary: the fused result is another draw of the same quantization noise, not the
    layered one's bits. So both are held to the exact (float-activation) model: the fused step as
    close to it as the layered path is, and greedy tokens the same up to a near tie (margin < 0.2)."""
    path = str(quantizable_checkpoint)
    exact = LLM(path, quantization=quantization, activation_quantization=None, progress=False)
    q8 = LLM(path, quantization=quantization, activation_quantization=activations, progress=False)
    assert_as_close_to_exact_as_layered(q8, exact, PROMPTS)


def assert_as_close_to_exact_as_layered(q8: LLM, exact: LLM, prompts: list[dict]) -> None:
    exact_tokens, exact_dists, _ = run(exact, False, prompts)
    fused_tokens, fused_dists, calls = run(q8, True, prompts)
    _, layered_dists, _ = run(q8, False, prompts)
    assert calls > 0
    runs = zip(fused_tokens, exact_tokens, fused_dists, exact_dists, layered_dists)
    for ours, exact, ours_dist, exact_dist, layered_dist in runs:
        same = next((i for i, (a, b) in enumerate(zip(ours, exact)) if a != b), len(ours))
        if same < len(ours):
            top = exact_dist[same].topk(2).values
            assert top[0] - top[1] < 0.2, f"diverged at step {same}, exact top-2 margin {top[0] - top[1]}"
        fused_error = (ours_dist[: same + 1] - exact_dist[: same + 1]).abs().mean()
        layered_error = (layered_dist[: same + 1] - exact_dist[: same + 1]).abs().mean()
        assert fused_error <= 2 * layered_error + 1e-3, (fused_error, layered_error)


def test_batches_past_the_row_kernels_take_the_fused_step_on_panels(quantizable_checkpoint):
    """40 streams (past KERNEL_MAX_BATCH, the row kernels' widest batch): the fused step runs them on
    every weight's panels, as close to the exact model as the layered path."""
    path = str(quantizable_checkpoint)
    exact = LLM(path, quantization="int4", activation_quantization=None, progress=False)
    q16 = LLM(path, quantization="int4", activation_quantization="int16", progress=False)
    prompts = [{"prompt_token_ids": [i + 1, 2 * i + 3, 5, i + 7]} for i in range(40)]
    assert_as_close_to_exact_as_layered(q16, exact, prompts)
    assert q16.engine.model.model.decode_step().max_batch >= len(prompts)


def with_half_group_down_projections(llm: LLM) -> LLM:
    """Each layer's down_proj as INT8 with groups of 16 (GGUF Q6_K's sub-blocks: two scales a chunk),
    rounded from its weight; the fused step is rebuilt at the next decode."""
    from llmpipe.quant.formats import Int8Weight
    from llmpipe.quant.linear import Int8Linear

    body = llm.engine.model.model
    for layer in body.layers:
        old = layer.mlp.down_proj
        w = old.dequantize().unflatten(1, (-1, 16))
        scale = w.abs().amax(-1).clamp_min(1e-8) / 31
        q = torch.round(w / scale[..., None]).clamp(-32, 31).to(torch.int8).flatten(1)
        new = Int8Linear(old.in_features, old.out_features, False, 16)
        new.load_shard(None, Int8Weight(q, scale, 16))
        new.activation_bits = old.activation_bits
        layer.mlp.down_proj = new
    body._decode_step = False
    return llm


@pytest.mark.parametrize("activations", [None, "int16"])
def test_half_group_int8_weights_match_layer_by_layer(quantizable_checkpoint, activations):
    """INT8 groups of 16 (Q6_K's) through the fused step: the per-op path's row kernels, whose lanes take
    two scales a chunk; float activations to float32 rounding, 16-bit blocks as close to exact as layered."""
    path = str(quantizable_checkpoint)
    llm = with_half_group_down_projections(
        LLM(path, quantization="int8", activation_quantization=activations, progress=False))
    assert llm.engine.model.model.layers[0].mlp.down_proj.group_size == 16
    if activations is None:
        assert_matches_layered(llm, atol=2e-5)
        assert_matches_layered(llm, atol=2e-5, prompts=(PROMPTS * 4)[:11])
    else:
        assert_matches_layered(llm, atol=0.05, near_tie=0.2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window", "gemma3"])
def test_int8_caches_take_the_fused_step_and_match_layer_by_layer(tiny_checkpoint, name, threads):
    """An int8 KV cache: the step quantizes the new K and V as the cache does (quant/kv.py) and attends
    to the codes dequantized as the layered path reads them — alone, batched, and past 256 positions
    (split over 2 threads), with windows and Gemma's cache groups."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(str(tiny_checkpoint(name)), kv_cache_dtype="int8", progress=False)
        assert llm.engine.model.model.decode_step().takes(1, llm.engine.core.runner.kv_cache.layers)
        # Gemma's k-norm runs in C here and in PyTorch there, equal to float32 rounding: a rounding that
        # lands on the other side of an int8 code's boundary moves a logprob by up to ~3e-4.
        atol = 1e-3 if name == "gemma3" else 2e-5
        assert_matches_layered(llm, atol=atol)
        assert_matches_layered(llm, atol=atol, prompts=[LONG_PROMPT, PROMPTS[1]])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
def test_the_fused_step_writes_an_int8_cache_bit_for_bit_as_the_layered_path(tiny_checkpoint, name):
    """Each new K and V quantized as quant/kv.py quantizes them: the same codes and float16 scales
    (bodies without q/k norms, whose K the two paths compute bit for bit)."""
    caches = []
    for fused in (True, False):
        llm = LLM(str(tiny_checkpoint(name)), kv_cache_dtype="int8", max_num_blocks=512, enable_prefix_caching=False,
                  progress=False)
        llm.engine.model.model.fused_decode = fused
        llm.generate([LONG_PROMPT, PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                     use_tqdm=False)
        caches.append(llm.engine.core.runner.kv_cache.tensors)
    for ours, theirs in zip(*caches):
        assert ours.dtype in (torch.int8, torch.float16) and torch.equal(ours, theirs)


def test_int4_caches_keep_the_layered_path(tiny_checkpoint):
    quantized_cache = LLM(str(tiny_checkpoint("llama_gqa")), kv_cache_dtype="int4", progress=False)
    step = quantized_cache.engine.model.model.decode_step()
    assert not step.takes(1, quantized_cache.engine.core.runner.kv_cache.layers)
    _, _, calls = run(quantized_cache, True, PROMPTS[:1], steps=4)
    assert calls == 0


def test_bfloat16_model_keeps_the_layered_path(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), dtype="bfloat16", progress=False)
    assert LlamaDecodeStep.build(llm.engine.model.model.layers, llm.engine.model.config) is None


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_float_batch_weights_give_the_codes_results_for_big_batches(quantizable_checkpoint, quantization):
    """float_batch_weights: batches of FLOAT_BATCH_MIN_ROWS rows or more (prefill, 20 streams) use the
    dequantized copy in the float GEMM, fewer rows the fused step on the codes; every step's
    distribution stays within float rounding of the plain quantized engine, tokens identical."""
    from llmpipe.quant.linear import FLOAT_BATCH_MIN_ROWS, QuantizedLinear

    path = str(quantizable_checkpoint)
    plain = LLM(path, quantization=quantization, activation_quantization=None, progress=False)
    copied = LLM(path, quantization=quantization, activation_quantization=None, float_batch_weights=True, progress=False)
    layers = [m for m in copied.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.float_weight is not None for m in layers)
    copies = sum(m.float_weight.numel() * 4 for m in layers)
    assert copied.engine.weight_bytes == plain.engine.weight_bytes + copies
    for prompts in ((PROMPTS * 7)[:20], PROMPTS):  # 20 rows ≥ FLOAT_BATCH_MIN_ROWS, then 3 rows < it
        assert (len(prompts) >= FLOAT_BATCH_MIN_ROWS) == (prompts is not PROMPTS)
        ours_tokens, ours_dists, calls = run(copied, True, prompts)
        theirs_tokens, theirs_dists, _ = run(plain, True, prompts)
        assert (calls == 0) == (len(prompts) >= FLOAT_BATCH_MIN_ROWS)  # the fused step only below it
        assert ours_tokens == theirs_tokens
        for ours, theirs in zip(ours_dists, theirs_dists):
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("activations", [None, "int16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_experts_match_layer_by_layer(tiny_checkpoint, quantization, activations):
    """INT4 / INT8 experts in the step, alone and batched (11 rows: experts with several, panels where the
    activations are quantized): float activations to float32 rounding, 16-bit blocks to their noise."""
    llm = LLM(str(tiny_checkpoint("qwen3_moe")), quantization=quantization, group_size=32,
              activation_quantization=activations, progress=False)
    assert llm.engine.model.model.decode_step() is not None
    tolerance = dict(atol=2e-5) if activations is None else dict(atol=0.05, near_tie=0.2)
    assert_matches_layered(llm, prompts=PROMPTS[:1], **tolerance)
    assert_matches_layered(llm, prompts=(PROMPTS * 4)[:11], **tolerance)
