"""Several adapters in one batch: the grouped shrink / expand against the row-by-row reference, on float and
quantized base layers, and rows of each adapter in one engine forward (prefill chunks and a decode-only batch,
in the fused decode kernel and layer by layer) against PEFT's merged model of that adapter."""

from __future__ import annotations

import pytest
import torch

from llmpipe.layers.linear import Linear
from llmpipe.lora import LoRAFactors, LoRAManager, reference_delta
from llmpipe.lora.batch import LoRABatch
from llmpipe.lora.slots import ModuleSlots
from llmpipe.models.llama.decode_step import LlamaDecodeStep
from llmpipe.quant.linear import Int4Linear, Int8Linear
from tests.lora.helpers import batch_forward, merged_logits, save_peft_adapter

PROMPTS = [
    [1, 17, 250, 33, 91, 5, 160, 77, 300, 12],
    [1, 40, 41, 42, 43],
    [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12],
    [1, 100, 200, 33],
    [1, 5, 6, 7, 8, 9, 10],
]
ADAPTERS = ["r2", None, "r8", "r4", "r2"]  # r2's rows are not contiguous


def random_factors(rank: int, in_features: int, out_features: int, seed: int) -> LoRAFactors:
    g = torch.Generator().manual_seed(seed)
    return LoRAFactors(torch.randn(rank, in_features, generator=g), torch.randn(out_features, rank, generator=g) * 0.1)


@pytest.mark.parametrize("make_layer", [
    lambda: Linear(64, 96, bias=True),
    lambda: Int8Linear(64, 96, bias=False, group_size=None),
    lambda: Int4Linear(64, 96, bias=False, group_size=32),
], ids=["float", "int8", "int4"])
@pytest.mark.parametrize("slot_of_row", [
    [0, None, 2, 2, 1, 0, None, 0, 1, 2, None, 2, 0, 1, 1, 2],  # batch 16, three adapters interleaved
    [1, 1, 1, 1, 1],  # one adapter, every row: a slice
    [None, None, None],  # no adapter rows: the base output untouched
], ids=["interleaved", "single", "none"])
def test_grouped_delta_equals_per_row_reference_on_every_base_kind(make_layer, slot_of_row):
    torch.manual_seed(0)
    layer = make_layer()
    if isinstance(layer, Linear):
        torch.nn.init.normal_(layer.weight, std=0.1)
        torch.nn.init.normal_(layer.bias, std=0.1)
    else:
        layer.load_shard(None, torch.randn(96, 64) * 0.1)
    slots = ModuleSlots(3, 16, 64, 96, torch.float32, torch.device("cpu"))
    factors = [random_factors(rank, 64, 96, seed) for seed, rank in enumerate((2, 8, 16))]
    for slot, f in enumerate(factors):
        slots.set(slot, f)
    x = torch.randn(len(slot_of_row), 64)
    base = layer(x)
    with torch.inference_mode():
        ours = LoRABatch(slot_of_row).add_delta(layer(x), x, slots)
    expected = base + reference_delta(x, [None if s is None else factors[s] for s in slot_of_row], 96)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def three_adapters(lora_base, tmp_path_factory):
    """Adapters of ranks 2, 4 and 8 on different modules, saved by PEFT."""
    base = lora_base[1]
    root = tmp_path_factory.mktemp("three")
    return {
        "r2": save_peft_adapter(base, root / "r2", seed=11, r=2, alpha=4),
        "r4": save_peft_adapter(base, root / "r4", seed=12, r=4, alpha=4, targets=["q_proj", "v_proj", "down_proj"]),
        "r8": save_peft_adapter(base, root / "r8", seed=13, r=8, alpha=32, targets=["k_proj", "o_proj", "gate_proj"]),
    }


@pytest.fixture(scope="module")
def manager(lora_llm, three_adapters):
    manager = LoRAManager(lora_llm.engine.model, max_loras=4, max_lora_rank=8)
    for name, path in three_adapters.items():
        manager.load(name, path)
    return manager


def expected_logits(lora_base, adapters, prompt, name):
    return merged_logits(lora_base[1], None if name is None else adapters[name], prompt)


def test_one_prefill_of_three_adapters_and_the_base_equals_each_merged_model(lora_base, lora_llm, three_adapters, manager):
    logits = batch_forward(lora_llm, manager, PROMPTS, ADAPTERS)
    start = 0
    for prompt, name in zip(PROMPTS, ADAPTERS):
        expected = expected_logits(lora_base, three_adapters, prompt, name)
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=1e-4, rtol=0, msg=str(name))
        start += len(prompt)


@pytest.mark.parametrize("fused", [True, False])
def test_a_decode_batch_with_adapters_equals_each_merged_model_in_the_fused_kernel_and_layer_by_layer(
        lora_base, lora_llm, three_adapters, manager, monkeypatch, fused):
    body = lora_llm.engine.model.model
    assert body.decode_step() is not None  # this model's decode batches take the fused kernel
    calls = []
    original = LlamaDecodeStep.__call__
    monkeypatch.setattr(LlamaDecodeStep, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    monkeypatch.setattr(body, "fused_decode", fused)
    body.reset_decode_step()
    try:
        logits = batch_forward(lora_llm, manager, PROMPTS, ADAPTERS, decode=True)
    finally:
        body.reset_decode_step()
    assert len(calls) == fused  # the kernel adds the adapters' deltas itself (LoraDesc), or the layers' hooks do
    for row, (prompt, name) in enumerate(zip(PROMPTS, ADAPTERS)):
        expected = expected_logits(lora_base, three_adapters, prompt, name)[-1]
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0, msg=str(name))
    assert not body.lora_active and (manager.row_slot == -1).all()


def test_a_step_without_adapter_rows_adds_no_hooks_and_keeps_the_fused_kernel(lora_llm, manager):
    model = lora_llm.engine.model
    with manager.step([None, None]):
        assert not model.model.lora_active
        assert not any(m._forward_hooks for m in model.modules())
    with manager.step(["r8", None]):
        assert not model.model.lora_active  # float32 factors: the fused kernel reads them (LoraDesc)
        assert manager.row_slot[:3].tolist() == [manager.slot_of["r8"], -1, -1]
        hooked = {name for name, m in model.named_modules() if m._forward_hooks}
    # r8 adapts k (in qkv_proj), o_proj and gate (in gate_up_proj): only those layers are hooked
    assert hooked == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                           "mlp.gate_up_proj")}
    assert not any(m._forward_hooks for m in model.modules())
