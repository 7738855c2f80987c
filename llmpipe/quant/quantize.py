"""`llmpipe quantize`: a float model → a GPTQ / AWQ / round-to-nearest 4-bit Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import EngineConfig
from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.quant.awq import awq_layer_quantizer
from llmpipe.quant.calibrate import calibration_samples, linear_modules, quantize_layers
from llmpipe.quant.export import quantization_config, save_quantized
from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.gptq import gptq_layer_quantizer
from llmpipe.models.registry import FAMILIES, family_of
from llmpipe.quant.rtn import quantize_int4

METHODS = ("gptq", "awq", "rtn")  # rtn: no calibration, written in the GPTQ layout (the baseline)
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "eval" / "data" / "othello.txt"


def quantize_model(
    model: str,
    method: str,
    out: Path,
    group_size: int = 128,
    act_order: bool = False,
    calib: Path = CALIBRATION_TEXT,
    num_samples: int = 32,
    seq_len: int = 512,
    damp_percent: float = 0.01,
    num_threads: int | None = None,
    progress: bool = True,
) -> Path:
    if method not in METHODS:
        raise InvalidRequestError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if group_size < 1:
        raise InvalidRequestError(f"group_size must be positive, got {group_size}")
    blocks = -(-seq_len // EngineConfig.block_size)
    config = EngineConfig(
        model=model, dtype="float32", quantization=None, max_num_blocks=blocks, max_model_len=seq_len,
        num_threads=num_threads,
    )
    from llmpipe.engine.engine import LLMEngine  # deferred: `llmpipe quantize --help` needs no engine

    engine = LLMEngine(config, progress=progress)
    architecture = engine.config.model_config.architecture
    if architecture not in family_of(architecture).hf_architectures:  # those whose config.json export writes
        supported = [name for family in FAMILIES for name in family.hf_architectures]
        raise UnsupportedModelError(f"quantize supports {', '.join(supported)} models, not {architecture!r}")
    if method == "rtn":
        quantized = _rtn(engine.model, group_size)
    else:
        if engine.tokenizer is None:
            raise InvalidRequestError(f"{model} has no tokenizer to turn the calibration text into tokens")
        text = _read_text(calib)
        samples = calibration_samples(engine.tokenizer, text, num_samples, seq_len)
        if method == "gptq":
            quantizer = gptq_layer_quantizer(group_size, act_order, damp_percent)
        else:
            quantizer = awq_layer_quantizer(group_size)
        quantized = quantize_layers(engine, samples, quantizer, desc=method.upper())
    layout = "awq" if method == "awq" else "gptq"
    qconfig = quantization_config(layout, group_size, act_order and method == "gptq", damp_percent)
    save_quantized(out, engine.model, engine.config.model_config, engine.tokenizer, quantized, qconfig)
    return out


def _rtn(model, group_size: int) -> dict[str, Int4Weight]:
    return {
        f"model.layers.{i}.{name}": quantize_int4(module.weight, group_size, min_zero=1)
        for i, layer in enumerate(model.model.layers)
        for name, module in linear_modules(layer).items()
    }


def _read_text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read calibration text {path}: {exc}") from exc
