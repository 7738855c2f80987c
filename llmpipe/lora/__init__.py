"""LoRA adapters over a loaded model: PEFT and llama.cpp GGUF files read into one `LoRAAdapter`, and a
`LoRAManager` that serves several of them in one batch on top of any base linear layer (float or quantized)."""

from llmpipe.lora.adapter import LoRAAdapter, LoRAFactors
from llmpipe.lora.batch import LoRABatch, reference_delta
from llmpipe.lora.manager import LoRAManager, read_adapter
from llmpipe.lora.request import LoRARequest
from llmpipe.lora.targets import LoRATargets

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAFactors", "LoRAManager", "LoRARequest", "LoRATargets", "read_adapter",
           "reference_delta"]
