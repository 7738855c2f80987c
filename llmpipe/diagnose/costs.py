"""What a forward pass costs, from a model's config: matmul FLOPs and bytes read (the roofline's axes).

A mixture of experts' token multiplies only its k of E experts' weights, and a decode step of B tokens
reads the experts any of them was routed to: E · (1 − (1 − k/E)^B) of them, routing taken as uniform.
"""

from __future__ import annotations

import math
import re

from llmpipe.config import ModelConfig
from llmpipe.loader.weight_names import expected_weight_shapes
from llmpipe.models.registry import family_of
from llmpipe.models.weights import EMBED

EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.")  # one routed expert's matrix, as checkpoints name it


def expert_share(cfg: ModelConfig, batch: float = 1) -> float:
    """The share of a layer's routed experts a decode step of `batch` tokens reads (1 for a dense model)."""
    routing = family_of(cfg.architecture).routing(cfg)
    if routing is None:
        return 1.0
    experts, per_token = routing
    return 1 - (1 - per_token / experts) ** batch


def read_share(cfg: ModelConfig, name: str, share: float) -> float:
    """The share of weight `name` a step reads, given the share of the routed experts it reads. An embedding
    that is not also the LM head gives each token one row: none of it, to the roofline (gpt-oss-20b's is
    0.58 B of its 4.2 B parameters a token would otherwise be said to read)."""
    if name == EMBED and not cfg.tie_word_embeddings:
        return 0.0
    return share if EXPERT_WEIGHT.search(name) else 1.0


def active_fraction(cfg: ModelConfig, batch: float = 1) -> float:
    """The share of the weights (by parameters) a decode step of `batch` tokens reads."""
    share, total, active = expert_share(cfg, batch), 0, 0.0
    for name, shape in expected_weight_shapes(cfg).items():
        numel = math.prod(shape)
        total += numel
        active += numel * read_share(cfg, name, share)
    return active / total


def is_decoder_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A weight matrix inside a decoder block: multiplied by every token (and what quantization applies to)."""
    return len(shape) == 2 and name.startswith("model.layers.")


def decoder_linear_params(cfg: ModelConfig) -> float:
    """The decoder's matrix parameters one token multiplies: a mixture of experts' k of E experts only."""
    share = expert_share(cfg)
    return sum(s[0] * s[1] * read_share(cfg, name, share)
               for name, s in expected_weight_shapes(cfg).items() if is_decoder_linear(name, s))


def attended(cfg: ModelConfig, context: float) -> float:
    """Keys one query reads at this context (a sliding window caps it)."""
    return min(context, cfg.sliding_window) if cfg.sliding_window else context


def attention_flops(cfg: ModelConfig, keys: float) -> float:
    """One query against `keys` cached positions in every layer: q·K and weights·V."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * keys


def lm_head_flops(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """A whole prompt: every token through the decoder's linears, causal attention, the LM head on the last."""
    keys = sum(attended(cfg, i) for i in range(1, prompt_len + 1))
    return 2 * decoder_linear_params(cfg) * prompt_len + attention_flops(cfg, keys) + lm_head_flops(cfg)


def decode_flops(cfg: ModelConfig, context: float) -> float:
    """One decoded token whose query attends `context` positions."""
    return 2 * decoder_linear_params(cfg) + attention_flops(cfg, attended(cfg, context)) + lm_head_flops(cfg)


def mean_decode_context(prompt_len: int, output_len: float) -> float:
    """Positions attended per decode step, averaged over the steps that produce tokens 2…n."""
    return prompt_len + output_len / 2


def decode_step_bytes(cfg: ModelConfig, weight_bytes: float, kv_bytes_per_token: float, batch: int,
                      context: float) -> float:
    """A decode step of `batch` sequences reads every weight it needs once (a mixture of experts: the
    experts its tokens were routed to) and each sequence's cached K/V."""
    return weight_bytes * active_fraction(cfg, batch) + batch * kv_bytes_per_token * attended(cfg, context)


def prefill_bytes(weight_bytes: int, kv_bytes_per_token: int, tokens: int, chunk_tokens: int) -> float:
    """Prefill reads the weights once per chunk of at most chunk_tokens and writes every token's K/V."""
    return -(-tokens // chunk_tokens) * weight_bytes + tokens * kv_bytes_per_token
