"""LoRA through the engine: one LLM.generate batch mixing three adapters and the base model against PEFT's
merged model of each, the prefix cache keyed by the adapter's contents, loading and unloading at run time, and
the options and requests that are refused."""

from __future__ import annotations

import math

import pytest
import torch

from llmpipe import LLM, LoRARequest, SamplingParams
from llmpipe.config import EngineConfig
from llmpipe.errors import InvalidRequestError
from tests.lora.helpers import hf_model, merged_logits, save_peft_adapter

PROMPTS = [
    [1, 17, 250, 33, 91, 5, 160, 77, 300, 12],
    [1, 40, 41, 42, 43, 44],
    [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12, 13],
    [1, 100, 200, 33, 7],
]
TOKENS = 16


@pytest.fixture(scope="module")
def adapters(lora_base, tmp_path_factory):
    """Three PEFT adapters of different ranks and targets: name → directory."""
    _, base = lora_base
    root = tmp_path_factory.mktemp("engine_adapters")
    return {
        "all8": save_peft_adapter(base, root / "all8", seed=11, r=8, alpha=16),
        "qv4": save_peft_adapter(base, root / "qv4", seed=12, r=4, alpha=8, targets=["q_proj", "v_proj"]),
        "mlp16": save_peft_adapter(base, root / "mlp16", seed=13, r=16, alpha=16, targets=["gate_proj", "up_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def lora_engine(lora_base):
    with LLM(str(lora_base[0]), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, progress=False) as llm:
        yield llm


def merged(base, adapter_dir):
    """PEFT's merged model of adapter_dir (the base model where None)."""
    import copy

    from peft import PeftModel

    return base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (generate with do_sample=False, not stopping at EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_one_batch_of_three_adapters_and_the_base_equals_peft_merged_models(lora_base, lora_engine, adapters):
    _, base = lora_base
    names = ["all8", None, "qv4", "mlp16"]
    requests = [LoRARequest(n, i + 1, str(adapters[n])) if n else None for i, n in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, prompt_logprobs=0)
    outputs = lora_engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=requests)
    for prompt, name, output in zip(PROMPTS, names, outputs):
        reference = merged(base, adapters[name] if name else None)
        assert output.outputs[0].token_ids == greedy(reference, prompt, TOKENS), name
        # the engine's prompt logprobs (its batched prefill under the adapter) against the reference's
        expected = torch.log_softmax(merged_logits(base, adapters[name] if name else None, prompt), -1)
        for q, entry in enumerate(output.prompt_logprobs[1:]):
            token = prompt[q + 1]
            assert math.isclose(entry[token].logprob, expected[q, token].item(), abs_tol=1e-4), (name, q)


def test_score_under_an_adapter_equals_peft_merged_logits(lora_base, lora_engine, adapters):
    _, base = lora_base
    lora_engine.add_lora(LoRARequest("all8", 1, str(adapters["all8"])))
    logits = lora_engine.engine.score(PROMPTS[0], lora_name="all8")
    torch.testing.assert_close(logits, merged_logits(base, adapters["all8"], PROMPTS[0]), atol=1e-4, rtol=0)


def test_prefix_blocks_are_shared_within_an_adapter_only(lora_engine, adapters):
    prompt = {"prompt_token_ids": [1] + list(range(60, 100))}  # two full blocks and more
    params = SamplingParams(temperature=0.0, max_tokens=2)
    all8 = LoRARequest("all8", 1, str(adapters["all8"]))
    first = lora_engine.generate(prompt, params, lora_request=all8)[0]
    assert first.num_cached_tokens == 0
    assert lora_engine.generate(prompt, params)[0].num_cached_tokens == 0  # the base model: its own blocks
    assert lora_engine.generate(prompt, params, lora_request=all8)[0].num_cached_tokens >= 32
    qv4 = LoRARequest("qv4", 2, str(adapters["qv4"]))
    assert lora_engine.generate(prompt, params, lora_request=qv4)[0].num_cached_tokens == 0


def test_an_adapter_reloaded_with_other_weights_never_meets_its_old_blocks(lora_engine, adapters):
    prompt = {"prompt_token_ids": [1] + list(range(200, 240))}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    if "swap" in lora_engine.list_loras():
        lora_engine.remove_lora("swap")
    lora_engine.generate(prompt, params, lora_request=LoRARequest("swap", 9, str(adapters["all8"])))
    lora_engine.remove_lora("swap")
    again = lora_engine.generate(prompt, params, lora_request=LoRARequest("swap", 9, str(adapters["qv4"])))[0]
    assert again.num_cached_tokens == 0
    lora_engine.remove_lora("swap")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'swap'"):
        lora_engine.remove_lora("swap")


def test_a_cache_salt_keeps_blocks_apart_beside_the_adapter(lora_engine):
    tokens = [1] + list(range(250, 290))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    lora_engine.generate({"prompt_token_ids": tokens, "cache_salt": "tenant-a"}, params)
    assert lora_engine.generate({"prompt_token_ids": tokens, "cache_salt": "tenant-b"}, params)[0].num_cached_tokens == 0
    assert lora_engine.generate({"prompt_token_ids": tokens, "cache_salt": "tenant-a"}, params)[0].num_cached_tokens >= 32


def test_requests_naming_an_adapter_not_loaded_are_refused(lora_engine):
    from llmpipe.engine.core_messages import EngineCoreRequest

    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'ghost'"):
        lora_engine.engine.core.add_request(EngineCoreRequest("x", [1, 2, 3], SamplingParams(), lora_name="ghost"))
    with pytest.raises(InvalidRequestError, match="gives no lora_path"):
        lora_engine.generate([1, 2, 3], lora_request=LoRARequest("ghost", 5))


def test_an_adapter_above_max_lora_rank_is_refused(lora_base, tmp_path):
    _, base = lora_base
    adapter = save_peft_adapter(base, tmp_path / "r8", seed=1, r=8, alpha=8)
    with LLM(str(lora_base[0]), enable_lora=True, max_lora_rank=4, progress=False) as llm:
        with pytest.raises(InvalidRequestError, match="max_lora_rank"):
            llm.add_lora(LoRARequest("r8", 1, str(adapter)))
        assert llm.list_loras() == {}


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_finish(lora_engine, adapters):
    engine = lora_engine.engine
    engine.add_request("busy", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True),
                       LoRARequest("all8", 1, str(adapters["all8"])))
    with pytest.raises(InvalidRequestError, match="in use by 1 request"):
        lora_engine.remove_lora("all8")
    while engine.has_unfinished_requests():
        engine.step()
    assert lora_engine.remove_lora("all8")
    assert "all8" not in lora_engine.list_loras()


def test_lora_modules_load_at_start_and_imply_enable_lora(lora_base, adapters):
    config = EngineConfig(model=str(lora_base[0]), lora_modules=[f"a={adapters['qv4']}",
                                                                  f'{{"name": "b", "path": "{adapters["all8"]}"}}'])
    assert config.enable_lora and config.lora_paths == {"a": str(adapters["qv4"]), "b": str(adapters["all8"])}
    with LLM(str(lora_base[0]), lora_modules=config.lora_modules, progress=False) as llm:
        assert llm.list_loras() == config.lora_paths
        assert llm.engine.core.info(0).loras == config.lora_paths


@pytest.mark.parametrize("options,message", [
    (dict(enable_lora=True, tensor_parallel_size=2), "tensor_parallel_size 1"),
    (dict(enable_lora=True, speculative_method="ngram"), "speculative decoding"),
    (dict(lora_modules=["no-equals-sign"]), "name=path"),
    (dict(lora_modules=["a=/x", "a=/y"]), "given twice"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank"),
])
def test_lora_options_that_cannot_run_are_refused_in_one_line(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**options)


def test_a_request_naming_an_adapter_without_enable_lora_is_refused(lora_llm):
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        lora_llm.generate([1, 2, 3], lora_request=LoRARequest("x", 1, "/nowhere"))


def test_lora_request_is_exported_as_vllm_spells_it():
    import llmpipe.lora

    request = llmpipe.lora.LoRARequest("sql", 3, "/adapters/sql")
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("sql", 3, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", 0, "/x")
    assert hf_model  # the helpers' model builder, used by the fixtures


def test_more_adapters_than_slots_take_turns_and_each_equals_its_merged_model(lora_base, adapters, monkeypatch):
    """max_loras 2 with three adapters loaded: one generate call under all three and the base completes, no step
    mixes more than two adapters, and every output is its merged model's (slots reused, vLLM's --max-loras)."""
    from llmpipe.lora.manager import LoRAManager

    _, base = lora_base
    mixed = []
    original = LoRAManager.step
    monkeypatch.setattr(LoRAManager, "step", lambda self, names, counts=None: mixed.append(
        {n for n in names if n}) or original(self, names, counts))
    names = ["all8", "qv4", None, "mlp16"]
    with LLM(str(lora_base[0]), dtype="float32", max_loras=2, max_lora_rank=16, progress=False,
             lora_modules=[f"{n}={adapters[n]}" for n in ("all8", "qv4", "mlp16")]) as llm:
        assert sorted(llm.list_loras()) == ["all8", "mlp16", "qv4"]
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        requests = [LoRARequest(n, i + 1, str(adapters[n])) if n else None for i, n in enumerate(names)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=requests)
    assert max(len(step) for step in mixed) == 2 and set().union(*mixed) == {"all8", "qv4", "mlp16"}
    for prompt, name, output in zip(PROMPTS, names, outputs):
        assert output.outputs[0].token_ids == greedy(merged(base, adapters[name] if name else None), prompt, TOKENS), name
