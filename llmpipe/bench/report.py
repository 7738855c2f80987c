"""Shared pieces of the benchmarks: random workloads, text tables, JSON output."""

from __future__ import annotations

import json
import random
from pathlib import Path


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """Random token ids (skipping the low ids where special tokens live)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, report: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return out
