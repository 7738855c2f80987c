"""transformers' generate() on the same checkpoint: the baseline each benchmark measures in its run."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def load_transformers_model(path: Path, dtype: torch.dtype):
    """The reference model on the same weights (GGUF file or Hugging Face directory)."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def time_generate(model, input_ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds for greedy generate() of exactly new_tokens tokens after input_ids [batch, len]."""
    attention_mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return time.perf_counter() - start


def best_ttft(model, prompt_ids: list[int], trials: int) -> float:
    input_ids = torch.tensor([prompt_ids])
    return min(time_generate(model, input_ids, 1) for _ in range(trials))


def measure(model, prompt_ids: list[int], new_tokens: int, batch: int = 1) -> dict:
    """TTFT (a 1-token generate) and decode tokens/s per sequence, from two timed runs."""
    input_ids = torch.tensor([prompt_ids] * batch)
    ttft = time_generate(model, input_ids, 1)
    total = time_generate(model, input_ids, new_tokens)
    decode_s = max(total - ttft, 1e-9)
    return {"ttft_s": ttft, "decode_tokens_per_s": (new_tokens - 1) / decode_s, "batch": batch}
