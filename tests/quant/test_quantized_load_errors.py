"""Every way a GPTQ / AWQ directory can be wrong gives one line that names the file and the field."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.loader import load_checkpoint

Q = "model.layers.0.self_attn.q_proj"


def edit_config(**changes):
    def mutate(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        qc = config["quantization_config"]
        for key, value in changes.items():
            if value is DROP:
                qc.pop(key)
            else:
                qc[key] = value
        if changes.get("quantization_config") is not None:
            config["quantization_config"] = changes["quantization_config"]
        (directory / "config.json").write_text(json.dumps(config))

    return mutate


def edit_tensors(change):
    def mutate(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        change(tensors)
        save_file(tensors, directory / "model.safetensors")

    return mutate


DROP = object()
GPTQ_CASES = [
    ("unknown method", edit_config(quant_method="bitsandbytes"), UnsupportedModelError,
     "quant_method 'bitsandbytes' is not supported (supported: gptq, awq, mxfp4)"),
    ("no method", edit_config(quant_method=DROP), ModelLoadError, "quantization_config is missing 'quant_method'"),
    ("8 bits", edit_config(bits=8), UnsupportedModelError, "gptq with bits=8 is not supported (only 4-bit)"),
    ("no bits", edit_config(bits=DROP), ModelLoadError, "quantization_config is missing 'bits'"),
    ("group size as text", edit_config(group_size="32"), ModelLoadError, "'group_size' must be int, got '32'"),
    ("group size of other files", edit_config(group_size=16), ModelLoadError,
     f"tensor {Q}.qzeros has shape [2, 8], expected [4, 8] (gptq, 4-bit, group_size 16)"),
    ("config not an object", edit_config(quantization_config=["gptq"]), ModelLoadError,
     "quantization_config must be a JSON object"),
    ("unknown checkpoint format", edit_config(checkpoint_format="marlin"), UnsupportedModelError,
     "checkpoint_format 'marlin' is not supported"),
    ("missing qzeros", edit_tensors(lambda t: t.pop(f"{Q}.qzeros")), ModelLoadError,
     f"gptq checkpoint is missing tensor {Q}.qzeros"),
    ("float qweight", edit_tensors(lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].float()})), ModelLoadError,
     f"tensor {Q}.qweight has dtype F32, expected I32"),
    ("short scales", edit_tensors(lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"][:1].clone()})), ModelLoadError,
     f"tensor {Q}.scales has shape [1, 64], expected [2, 64]"),
    ("act-order without g_idx", lambda d: (edit_config(desc_act=True)(d), edit_tensors(lambda t: t.pop(f"{Q}.g_idx"))(d)),
     ModelLoadError, f"gptq checkpoint is missing tensor {Q}.g_idx"),
]
AWQ_CASES = [
    ("gemv version", edit_config(version="gemv"), UnsupportedModelError, "AWQ version 'gemv' is not supported (only 'gemm')"),
    ("no zero points", edit_config(zero_point=False), UnsupportedModelError, "AWQ without zero points"),
    ("read as gptq", edit_config(quant_method="gptq"), ModelLoadError,
     f"tensor {Q}.weight has shape [8, 512], expected [64, 64]"),
]


@pytest.fixture(scope="module")
def layouts(quantized_dir):
    return {"gptq": quantized_dir("llama_gqa", "rtn"), "awq": quantized_dir("llama_gqa", "awq")}


def broken_copy(source: Path, tmp_path: Path, mutate) -> Path:
    directory = Path(shutil.copytree(source, tmp_path / "model"))
    mutate(directory)
    return directory


@pytest.mark.parametrize(
    "layout,mutate,error,message",
    [("gptq", *case[1:]) for case in GPTQ_CASES] + [("awq", *case[1:]) for case in AWQ_CASES],
    ids=[case[0] for case in GPTQ_CASES + AWQ_CASES],
)
def test_broken_quantized_directory_fails_with_one_clear_line(layouts, tmp_path, layout, mutate, error, message):
    directory = broken_copy(layouts[layout], tmp_path, mutate)
    with pytest.raises(error) as caught:
        load_checkpoint(str(directory))
    text = str(caught.value)
    assert message in text and str(directory) in text and "\n" not in text
    if error is ModelLoadError:
        assert not isinstance(caught.value, UnsupportedModelError)


def test_g_idx_that_does_not_form_groups_fails_when_the_weight_is_read(layouts, tmp_path):
    bad = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)  # groups of 32 expected
    directory = broken_copy(layouts["gptq"], tmp_path, edit_tensors(lambda t: t.update({f"{Q}.g_idx": bad})))
    checkpoint = load_checkpoint(str(directory))
    with pytest.raises(ModelLoadError, match=f"{Q}: g_idx does not split the input columns into groups of 32"):
        checkpoint.source.read(f"{Q}.weight")
