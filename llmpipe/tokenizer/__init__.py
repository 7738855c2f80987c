"""Text ↔ token ids: the Tokenizer (GGUF or Hugging Face files) and the streaming detokenizer."""

from llmpipe.tokenizer.detokenizer import IncrementalDetokenizer
from llmpipe.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from llmpipe.tokenizer.hf_tokenizer import load_hf_tokenizer
from llmpipe.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_gguf_tokenizer", "load_hf_tokenizer"]
