"""Loading checkpoints: aliases, GGUF files (dequantized) and Hugging Face safetensors directories."""

from llmpipe.loader.aliases import ALIASES, resolve_model
from llmpipe.loader.checkpoint import Checkpoint, WeightSource, load_checkpoint

__all__ = ["ALIASES", "Checkpoint", "WeightSource", "load_checkpoint", "resolve_model"]
