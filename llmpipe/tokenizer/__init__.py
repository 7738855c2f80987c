"""Text ↔ token ids: the Tokenizer (GGUF or Hugging Face files) and the streaming detokenizer."""

from llmpipe.tokenizer.detokenizer import IncrementalDetokenizer
from llmpipe.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
