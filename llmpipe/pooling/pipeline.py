"""A sentence-transformers directory's module pipeline, read from its files.

modules.json lists the modules in order; llmpipe computes Transformer → Pooling → Dense* → Normalize?
and refuses any other sequence or module. Each module's settings come from its folder:
sentence_bert_config.json (max_seq_length) beside the Transformer's files, 1_Pooling/config.json
(mean / cls / lasttoken), a Dense folder's config.json + model.safetensors (`linear.weight`,
`linear.bias`), and the Matryoshka dimensions the model card's training section declares, if any.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.files import read_json
from llmpipe.pooling.checkpoint import WEIGHTS_FILE, read_tensors

MODULES_FILE = "modules.json"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
MODEL_CARD = "README.md"
POOLING_MODES = ("mean", "cls", "lasttoken")
SENTENCE_EMBEDDING = "sentence_embedding"  # the feature Pooling writes and Dense / Normalize read
# sentence-transformers' model cards print the MatryoshkaLoss parameters as JSON.
_MATRYOSHKA = re.compile(r'"matryoshka_dims"\s*:\s*\[([\d,\s]+)\]')
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"Identity": lambda x: x, "Tanh": torch.tanh}
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_KIND_LETTERS = {"Transformer": "T", "Pooling": "P", "Dense": "D", "Normalize": "N"}


@dataclass(frozen=True)
class Dense:
    """sentence-transformers' Dense: activation(x @ weight.T + bias)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(F.linear(x, self.weight, self.bias))


@dataclass(frozen=True)
class SentencePipeline:
    transformer_dir: Path  # the Hugging Face files: config.json, model.safetensors, tokenizer.json
    max_seq_length: int | None  # None: the tokenizer's limit
    pooling: str  # one of POOLING_MODES
    dense: tuple[Dense, ...]
    normalize: bool
    matryoshka: tuple[int, ...] | None


def read_modules(path: Path) -> list[tuple[str, Path]] | None:
    """(kind, folder) per module of modules.json, the kind being the class name (Transformer, Pooling, ...);
    None without modules.json."""
    file = path / MODULES_FILE
    if not file.is_file():
        return None
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
        return [(entry["type"].rpartition(".")[2], path / entry.get("path", "")) for entry in entries]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise ModelLoadError(f"{file}: not a sentence-transformers module list ({error})") from error


def transformer_dir(path: Path) -> Path:
    """Where the Hugging Face files are: the Transformer module's folder (the directory itself, mostly)."""
    modules = read_modules(path) or []
    return next((folder for kind, folder in modules if kind == "Transformer"), path)


def read_pipeline(path: Path) -> SentencePipeline:
    modules = read_modules(path)
    if modules is None:
        raise UnsupportedModelError(f"{path}: no {MODULES_FILE}, so not a sentence-transformers model whose "
                                    "pooling llmpipe could read (it does not guess one)")
    order = "".join(_KIND_LETTERS.get(kind, "?") for kind, _ in modules)
    if not re.fullmatch(r"TPD*N?", order):
        raise UnsupportedModelError(f"{path}: modules {[kind for kind, _ in modules]}: llmpipe computes "
                                    "Transformer → Pooling → Dense* → Normalize (optional) only")
    folders = [folder for _, folder in modules]
    _check_embedding_output(folders[0])
    return SentencePipeline(
        transformer_dir=folders[0],
        max_seq_length=configured_max_length(folders[0]),
        pooling=_pooling_mode(read_json(folders[1] / "config.json"), folders[1]),
        dense=tuple(_dense(folder) for kind, folder in modules if kind == "Dense"),
        normalize=order.endswith("N"),
        matryoshka=_matryoshka_dims(path / MODEL_CARD),
    )


def configured_max_length(folder: Path) -> int | None:
    """The Transformer's max_seq_length in sentence_bert_config.json, if it sets one."""
    file = folder / TRANSFORMER_CONFIG
    length = read_json(file).get("max_seq_length") if file.is_file() else None
    return int(length) if length is not None else None


def _check_embedding_output(folder: Path) -> None:
    """The Transformer module hands Pooling the model's last hidden states (sentence-transformers 6 can name others)."""
    file = folder / TRANSFORMER_CONFIG
    config = read_json(file) if file.is_file() else {}
    if config.get("transformer_task", "feature-extraction") != "feature-extraction":
        raise UnsupportedModelError(f"{file}: transformer_task {config['transformer_task']!r} is not feature-extraction")
    text = {"method": "forward", "method_output_name": "last_hidden_state"} | config.get("modality_config", {}).get("text", {})
    if (text["method"], text["method_output_name"]) != ("forward", "last_hidden_state"):
        raise UnsupportedModelError(f"{file}: the text embedding is not the model's last_hidden_state")


def _pooling_mode(config: dict[str, Any], folder: Path) -> str:
    """The new spelling ("pooling_mode": "mean") or the old one ("pooling_mode_mean_tokens": true, ...)."""
    mode = config.get("pooling_mode", [name for key, name in _LEGACY_POOLING.items() if config.get(key)])
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in POOLING_MODES:
        raise UnsupportedModelError(f"{folder}: pooling {mode!r} is not supported (one of {', '.join(POOLING_MODES)})")
    return mode


def _dense(folder: Path) -> Dense:
    config = read_json(folder / "config.json")
    activation = config.get("activation_function", "Tanh")  # sentence-transformers' default when unsaid
    features = config.get("module_input_name", SENTENCE_EMBEDDING), config.get("module_output_name", SENTENCE_EMBEDDING)
    if config.get("use_residual") or features != (SENTENCE_EMBEDDING, SENTENCE_EMBEDDING):
        raise UnsupportedModelError(f"{folder}: a Dense with a residual or on other features than the sentence embedding")
    name = activation.rpartition(".")[2]
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{folder}: Dense activation {activation!r} is not supported ({', '.join(_ACTIVATIONS)})")
    tensors = read_tensors(folder)
    if "linear.weight" not in tensors:
        raise ModelLoadError(f"{folder}: no linear.weight in its {WEIGHTS_FILE}")
    weight, bias = tensors["linear.weight"], tensors.get("linear.bias")
    if weight.shape != (config["out_features"], config["in_features"]) or (bias is None) == config.get("bias", True):
        raise UnsupportedModelError(f"{folder}: linear.weight {tuple(weight.shape)} / bias do not match its config.json")
    return Dense(weight, bias, _ACTIVATIONS[name])


def _matryoshka_dims(card: Path) -> tuple[int, ...] | None:
    match = _MATRYOSHKA.search(card.read_text(encoding="utf-8", errors="replace")) if card.is_file() else None
    return tuple(int(dim) for dim in match.group(1).split(",") if dim.strip()) if match else None
