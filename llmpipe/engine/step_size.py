"""How many tokens one engine step computes (`max_num_batched_tokens`), and what its activations take.

By default a step takes up to STEP_TOKENS (vLLM's 2,048), halved down to llama.cpp's n_ubatch of 512 while its
float activations (`step_bytes`) would pass STEP_ACTIVATIONS_MAX: with the ~0.3 GiB the runtime holds, a process
then needs at most about 0.5 GiB beside its weights and KV pool. That keeps 2,048 for models up to ~1B (hidden
2,048) and takes 512 for an 8B, whose 2,048-token step held ~0.25 GiB more at its peak than after it. A smaller
step costs a model that size nothing measurable: each part re-reads the weights (0.2 s for an 8B's 4.6 GB),
against ~25 s of computing 512 tokens.
"""

from __future__ import annotations

from llmpipe.config import ModelConfig
from llmpipe.models.llama.model import MLP_CHUNK_ROWS

STEP_TOKENS = 2048  # the most a default step computes (vLLM's max_num_batched_tokens)
MIN_STEP_TOKENS = 512  # the fewest it is cut to (llama.cpp's n_ubatch)
STEP_ACTIVATIONS_MAX = 192 << 20


def step_bytes(cfg: ModelConfig, tokens: int) -> int:
    """A step's float32 activations at their peak: about eight [tokens, hidden] tensors alive at once (the
    residual, the norm's output, q/k/v, attention's output and RoPE's temporaries: 66 KB a token measured on
    Llama-3.2-1B, hidden 2,048), and the MLP's gate, up and product, 3 × intermediate floats a row for at most
    MLP_CHUNK_ROWS rows at a time."""
    return 4 * (8 * tokens * cfg.hidden_size + 3 * min(tokens, MLP_CHUNK_ROWS) * cfg.intermediate_size)


def default_step_tokens(cfg: ModelConfig) -> int:
    """STEP_TOKENS, halved (not below MIN_STEP_TOKENS) while a step's activations would pass STEP_ACTIVATIONS_MAX."""
    tokens = STEP_TOKENS
    while tokens > MIN_STEP_TOKENS and step_bytes(cfg, tokens) > STEP_ACTIVATIONS_MAX:
        tokens //= 2
    return tokens


def step_tokens(max_num_batched_tokens: int | None, cfg: ModelConfig) -> int:
    """The step's token budget: the one asked for, else the model's default."""
    return max_num_batched_tokens or default_step_tokens(cfg)
