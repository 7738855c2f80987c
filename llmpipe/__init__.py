"""llmpipe: an LLM inference engine in plain PyTorch."""

from llmpipe.errors import InvalidRequestError, LLMPipeError, ModelLoadError, UnsupportedModelError
from llmpipe.llm import LLM
from llmpipe.outputs import CompletionOutput, RequestOutput
from llmpipe.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "LLMPipeError",
    "ModelLoadError",
    "UnsupportedModelError",
    "InvalidRequestError",
]
