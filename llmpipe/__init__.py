"""llmpipe: an LLM inference engine in plain PyTorch.

The public names load on first use (PEP 562), so that a process needing only a light module (the
grammar worker, the CLI's help) does not import torch."""

from __future__ import annotations

from importlib import import_module

_HOMES = {
    "LLM": "llmpipe.llm",
    "SamplingParams": "llmpipe.sampling_params",
    "StructuredOutputsParams": "llmpipe.sampling_params",
    "RequestOutput": "llmpipe.outputs",
    "CompletionOutput": "llmpipe.outputs",
    "LLMPipeError": "llmpipe.errors",
    "ModelLoadError": "llmpipe.errors",
    "UnsupportedModelError": "llmpipe.errors",
    "InvalidRequestError": "llmpipe.errors",
    "LoRARequest": "llmpipe.lora.request",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'llmpipe' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
