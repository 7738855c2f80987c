"""llmpipe: an LLM inference engine in plain PyTorch."""

from llmpipe.errors import InvalidRequestError, LLMPipeError, ModelLoadError, UnsupportedModelError
from llmpipe.llm import LLM
from llmpipe.outputs import CompletionOutput, RequestOutput
from llmpipe.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LLMPipeError",
    "ModelLoadError",
    "UnsupportedModelError",
    "InvalidRequestError",
]
