"""GGUFs made with llama.cpp's optional fusions (`convert_hf_to_gguf.py --fuse-qkv`, `--fuse-gate-up-exps`) read as
the tensors the converter writes without them: the same model, its parts views of the file."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from llmpipe import LLM
from llmpipe.loader.gguf_names import GGUFArchitecture, converter_fusions
from llmpipe.models.registry import gguf_architecture
from tests.loader.gguf_helpers import GGUF_ARCH_OF, TensorSpec, hf_metadata, hf_tensors, write_gguf
from tests.loader.test_gguf_native_quant import mapped_file
from tests.models.test_llama_parity import PROMPT


def fuse(tensors: dict[str, TensorSpec], parts: list[str], fused: str, axis: int) -> None:
    """parts (GGUF names, float or (float, type)) → one tensor `fused`, concatenated along `axis` as the converter's
    torch.cat; a quantized one is quantized after (row-wise types: the same blocks as each part's)."""
    specs = [tensors.pop(p) for p in parts]
    qtype = specs[0][1] if isinstance(specs[0], tuple) else None
    data = np.concatenate([s[0] if qtype else s for s in specs], axis=axis)
    tensors[fused] = (data, qtype) if qtype else data


def write_pair(model: torch.nn.Module, name: str, tmp_path: Path, qtypes: dict[str, Q]) -> tuple[Path, Path]:
    """The model's GGUF as the converter writes it by default, and with both fusions (where it has the parts)."""
    arch = GGUF_ARCH_OF[name]
    tensors = hf_tensors(model.state_dict(), model.config, arch, qtypes)
    metadata = hf_metadata(model.config, arch)
    apart = write_gguf(tmp_path / "apart.gguf", arch, metadata, dict(tensors))
    for i in range(model.config.num_hidden_layers):
        for suffix in ("weight", "bias"):
            if f"blk.{i}.attn_q.{suffix}" in tensors:
                fuse(tensors, [f"blk.{i}.attn_{x}.{suffix}" for x in "qkv"], f"blk.{i}.attn_qkv.{suffix}", 0)
        if f"blk.{i}.ffn_gate_exps.weight" in tensors:  # [experts, inner, hidden]: each expert's gate rows, then up's
            fuse(tensors, [f"blk.{i}.ffn_{x}_exps.weight" for x in ("gate", "up")], f"blk.{i}.ffn_gate_up_exps.weight", 1)
    return apart, write_gguf(tmp_path / "fused.gguf", arch, metadata, tensors)


@pytest.mark.parametrize("name, qtypes", [
    ("llama_gqa", {}),  # q and k rows permuted by the converter before it fuses them
    ("llama_gqa", {f"model.layers.0.self_attn.{x}_proj.weight": Q.Q8_0 for x in "qkv"}),  # blocks, read in place
    ("qwen2", {}),  # q, k and v biases: attn_qkv.bias
    ("qwen3_moe", {f"model.layers.{i}.mlp.experts.{x}_proj.weight": Q.Q8_0 for i in range(2) for x in ("gate", "up")}),
], ids=["llama", "llama-q8_0", "qwen2-bias", "qwen3-moe-q8_0"])
def test_a_fused_gguf_is_the_model_its_unfused_twin_is(transformers_model, tmp_path, name, qtypes):
    model = copy.deepcopy(transformers_model(name))  # the fixture's model is shared: perturb a copy
    with torch.no_grad():  # biases that count (transformers starts them at zero)
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.5)
    apart, fused = write_pair(model, name, tmp_path, qtypes)
    names = {t.name for t in GGUFReader(fused).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    assert ("blk.0.ffn_gate_up_exps.weight" in names) == (name == "qwen3_moe")
    ours, theirs = (LLM(str(path), progress=False) for path in (fused, apart))
    assert torch.equal(ours.engine.score(PROMPT), theirs.engine.score(PROMPT))
    for module in ours.engine.model.modules():
        for _, blocks in getattr(module, "segment_blocks", list)():
            assert mapped_file(blocks.data_ptr()) in (None, fused.resolve())  # q, k: unpermuted copies


FUSED_QKV_TABLE = GGUFArchitecture(tensors={"blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
                                             "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight"})


@pytest.mark.parametrize("arch, names, fused", [
    ("llama", ["blk.0.attn_qkv.weight", "blk.0.attn_output.weight"], {"blk.0.attn_qkv.weight": "--fuse-qkv"}),
    ("qwen2", ["blk.0.attn_qkv.weight", "blk.0.attn_qkv.bias", "blk.0.attn_output.weight"],
     {"blk.0.attn_qkv.weight": "--fuse-qkv", "blk.0.attn_qkv.bias": "--fuse-qkv"}),
    ("qwen3moe", ["blk.0.attn_q.weight", "blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_down_exps.weight"],
     {"blk.0.ffn_gate_up_exps.weight": "--fuse-gate-up-exps"}),
    ("llama", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight"], {}),
    (FUSED_QKV_TABLE, ["blk.0.attn_qkv.weight", "blk.0.attn_output.weight"], {}),  # a family reading attn_qkv itself
    ("qwen35", ["blk.0.attn_qkv.weight", "blk.0.ssm_out.weight",  # a linear-attention layer's in_proj_qkv
                "blk.3.attn_q.weight", "blk.3.attn_output.weight"], {}),
    ("qwen35", ["blk.3.attn_qkv.weight", "blk.3.attn_output.weight"], {"blk.3.attn_qkv.weight": "--fuse-qkv"}),
])
def test_the_converters_optional_fusions_are_told_from_layouts_families_read(arch, names, fused):
    table = gguf_architecture(arch, Path("m.gguf")) if isinstance(arch, str) else arch
    assert converter_fusions(names, table) == fused
