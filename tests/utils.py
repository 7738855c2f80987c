"""Helpers shared by the tests (the fixtures in conftest.py build on them): tiny random-weight
transformers checkpoints of every family llmpipe serves, and their tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from llmpipe import SamplingParams

# Small but complete configurations of every Llama-family architecture llmpipe serves.
TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
# Qwen3.5's linear-attention and attention shapes on three layers (linear, full, linear) and the hybrids' experts.
QWEN35_HYBRID = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
TINY_HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80)
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # Window smaller than the test prompts, so it cuts in during prefill and decode.
    "mistral_window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # 8 experts, 2 a token, raw weights, a sigmoid-gated shared expert, qkv bias
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=64, shared_expert_intermediate_size=96)),
    # 8 experts, 3 a token, renormalized, in every layer (as the released models and llama.cpp's qwen3moe)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                                         norm_topk_prob=True)),
    # 8 biased experts, 3 a token, a SwiGLU clamp (0.6) low enough to cut in; windows of 8 (shorter than the test
    # prompts) on layers 0 and 2; YaRN without truncation, as gpt-oss's own.
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     intermediate_size=64, num_local_experts=8, num_experts_per_tok=3, sliding_window=8,
                                     swiglu_limit=0.6, rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                                        "original_max_position_embeddings": 128,
                                                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})),
    # Layers 0-4 local (window 16, shorter than the test prompts), layer 5 global; every Gemma 3 knob set.
    "gemma3": (
        "Gemma3TextConfig",
        dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
             query_pre_attn_scalar=24, final_logit_softcapping=5.0,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    ),
    # Three Gated DeltaNet layers, then a gated full-attention one; 2 key heads for 4 value heads, key and value
    # heads of different widths; RoPE on the first quarter (8) of each 32-channel head.
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=24, linear_conv_kernel_dim=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    ),
    # Qwen3.5's layers (a Gated DeltaNet, the gated full attention, another Gated DeltaNet) with a mixture of 8
    # experts, 2 a token, and a sigmoid-gated shared expert in place of every MLP.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(**QWEN35_HYBRID, **TINY_HYBRID_MOE)),
    # The same as Qwen3-Next: fused linear-layer projections; layer 2's MLP dense (mlp_only_layers).
    "qwen3_next": ("Qwen3NextConfig", dict(**QWEN35_HYBRID, **TINY_HYBRID_MOE, mlp_only_layers=[2])),
}


def build_tiny_checkpoint(name: str, out_dir: Path) -> Path:
    class_name, extra = TINY_CONFIGS[name]
    return build_checkpoint(class_name, extra, out_dir)


def build_checkpoint(class_name: str, extra: dict, out_dir: Path) -> Path:
    """A random-weight checkpoint of transformers' `class_name` (TINY_COMMON overridden by `extra`)."""
    import transformers

    config = getattr(transformers, class_name)(**{**TINY_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves tiny weights whose logits are nearly uniform; widen them so greedy
    # decoding has clear winners and a comparison of tokens means something.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
            elif config.model_type.startswith("gemma"):  # its norms scale by 1 + weight, zero at init
                param.normal_(0.0, 0.2)
            elif config.model_type == "gpt_oss" and not name.endswith("norm.weight"):  # biases and sinks, near zero at init
                param.normal_(0.0, 0.2)
            elif config.model_type in HYBRID_MODEL_TYPES:  # zero-centred norms (0 at init), dt_bias and gated norms (1), A_log
                param.add_(torch.randn_like(param), alpha=0.2)
    model.save_pretrained(out_dir)
    save_tiny_tokenizer(out_dir, TINY_COMMON["vocab_size"])
    return out_dir


# DeepSeek V4 at its smallest, every kind of part in it: a window-only layer, two CSA layers (ratio 4) and
# an HCA one (ratio 16), all with an 8-token window; an indexer keeping 4 entries (16 index heads: an exact
# tie between ReLU scores all but impossible); a hash-routed MoE layer, then three top-k ones (4 experts,
# 2 per token); 3 hyper-connection streams (with 2, every doubly stochastic mix is symmetric); RoPE on the
# last 8 of 32 channels per head, YaRN (factor 4) on the compressed layers; a SwiGLU clamp (1.0) low
# enough to cut in.
TINY_DEEPSEEK_V4 = dict(
    vocab_size=TINY_COMMON["vocab_size"], hidden_size=64, moe_intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=8, index_n_heads=16, index_head_dim=16, index_topk=4,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2, swiglu_limit=1.0,
    hc_mult=3, max_position_embeddings=512,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    bos_token_id=TINY_COMMON["bos_token_id"], eos_token_id=TINY_COMMON["eos_token_id"],
)


def tiny_deepseek_v4_model(seed: int = 0, **overrides):
    """transformers' DeepseekV4ForCausalLM (float32) of TINY_DEEPSEEK_V4 + overrides, every weight random and
    mattering: matrices widened, norms near 1, random sinks, position biases, hyper-connection biases and
    scales and router correction biases (all zero at init), and a tid2eid of distinct random experts per token."""
    import transformers

    config = transformers.DeepseekV4Config(**{**TINY_DEEPSEEK_V4, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif param.dim() > 1 and not name.endswith("position_bias"):
                param.normal_(0.0, 0.08)
            else:
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
            elif name.endswith("tid2eid"):
                buffer.copy_(torch.rand(buffer.shape[0], config.n_routed_experts).argsort(-1)[:, : buffer.shape[1]])
    return model


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_tokenizer(out_dir: Path, vocab_size: int, corpus: list[str] | None = None) -> None:
    """A byte-level BPE trained on a little text (`corpus`, or two sentences), saved as tokenizer.json +
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (corpus or ["the quick brown fox jumps over the lazy dog", "how does inference work?"]) * 50
    backend.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out_dir)


def reference_state_dict(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under the names its checkpoint saves them by: a tied head left out, fused
    3-D experts (gate_up_proj [experts, 2 × inner, hidden], down_proj) one gate / up / down matrix per expert
    (gpt-oss's: [experts, in, out], gate and up interleaved, with biases)."""
    if model.config.model_type == "gpt_oss":
        return gpt_oss_expert_slices(model.state_dict())
    state = {}
    tensors = model.state_dict()
    if model.config.model_type == "qwen3_next":
        tensors = split_fused_projections(tensors, model.config)
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                state |= {f"{prefix}{e}.gate_proj.weight": gate, f"{prefix}{e}.up_proj.weight": up}
        elif name.endswith("mlp.experts.down_proj"):
            state |= {f"{name.removesuffix('down_proj')}{e}.down_proj.weight": t for e, t in enumerate(tensor)}
        else:
            state[name] = tensor
    return state


def split_fused_projections(state: dict[str, torch.Tensor], config, fused: tuple[str, ...] = ("qkvz", "ba")) -> dict:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (rows per key head: [q | k | v | z], [b | a]) as Qwen3.5's in_proj_qkv
    (all q, all k, all v), in_proj_z, in_proj_b and in_proj_a, which llmpipe loads them as."""
    heads, per_key = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    sizes = {"qkvz": [config.linear_key_head_dim] * 2 + [per_key * config.linear_value_head_dim] * 2, "ba": [per_key] * 2}
    split = {}
    for name, t in state.items():
        kind = name.rpartition(".in_proj_")[2].removesuffix(".weight")
        if ".linear_attn.in_proj_" not in name or kind not in fused:
            split[name] = t
            continue
        parts = [p.reshape(-1, t.shape[1]) for p in t.view(heads, -1, t.shape[1]).split(sizes[kind], 1)]
        prefix = name.removesuffix(f"{kind}.weight")
        named = {"qkv": torch.cat(parts[:3]), "z": parts[3]} if kind == "qkvz" else dict(zip("ba", parts))
        split |= {f"{prefix}{part}.weight": p for part, p in named.items()}
    return split


def gpt_oss_expert_slices(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's 3-D experts as each expert's gate / up / down weight [out, in] and bias (gate: even columns of
    gate_up, up: odd ones)."""
    state = {}
    for name, tensor in state_dict.items():
        prefix, _, kind = name.rpartition(".")
        if kind not in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            state[name] = tensor
            continue
        bias = kind.endswith("_bias")
        rows = tensor if bias else tensor.transpose(1, 2)  # [experts, out, (in)]
        parts = {"gate_proj": rows[:, 0::2], "up_proj": rows[:, 1::2]} if kind.startswith("gate_up") else {"down_proj": rows}
        for part, data in parts.items():
            state |= {f"{prefix}.{e}.{part}.{'bias' if bias else 'weight'}": data[e] for e in range(data.shape[0])}
    return state


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(5, 320) for _ in range(length - 1)]


def reference_greedy(reference, tokens: list[int], steps: int = 32, one_by_one: bool = False) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation on its own cache, EOS allowed as llmpipe's ignore_eos allows it
    (`generate`'s min_new_tokens would mask it), and its logits [steps, vocab]. one_by_one: the prompt too is
    fed one token per forward, so each token is rotated with the LongRoPE factors in force at its position
    (no `generate`, hence no re-encoding at the switch)."""
    import transformers

    cache, generated, logits = transformers.DynamicCache(config=reference.config), [], []
    feed = [[t] for t in tokens] if one_by_one else [tokens]
    with torch.no_grad():
        while len(generated) < steps:
            out = reference(torch.tensor([feed.pop(0) if feed else generated[-1:]]), cache=cache, use_cache=True)
            if not feed:
                logits.append(out.logits[0, -1])
                generated.append(int(logits[-1].argmax()))
    return generated, torch.stack(logits)


def assert_greedy_run_matches(llm, tokens: list[int], expected: tuple[list[int], torch.Tensor]) -> None:
    """32 greedy tokens identical to the reference's, and every step's distribution within 1e-4."""
    vocab = llm.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=vocab)
    out = llm.generate([{"prompt_token_ids": tokens}], params)[0].outputs[0]
    assert out.token_ids == expected[0]
    ours = torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in out.logprobs])
    torch.testing.assert_close(ours, expected[1].log_softmax(-1), atol=1e-4, rtol=0)


def reference_case(path: Path):
    """(path, transformers' float32 model, llmpipe's LLM) of one checkpoint: a parity test's three."""
    import transformers

    from llmpipe import LLM

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference, LLM(str(path), progress=False)


def assert_prefill_matches(llm, reference, tokens: list[int]) -> None:
    """Every position's logits within 1e-4 of transformers'."""
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(llm.engine.score(tokens), theirs, atol=1e-4, rtol=0)
