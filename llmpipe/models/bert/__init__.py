"""BERT encoders (sentence embeddings, cross-encoder reranking): served by llmpipe.pooling, not the paged-KV engine."""
