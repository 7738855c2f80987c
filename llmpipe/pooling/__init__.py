"""Encoder models for embeddings and rerank (BERT, EmbeddingGemma, BERT cross-encoders).

They attend bidirectionally and run one forward per padded batch, with no KV cache, so they live beside
the paged-KV engine rather than in it; see encoder.py for the interface and load_encoder.
"""

from llmpipe.pooling.encoder import Encoder, is_encoder, load_encoder

__all__ = ["Encoder", "is_encoder", "load_encoder"]
