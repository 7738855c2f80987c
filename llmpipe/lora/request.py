"""LoRARequest: which adapter a request of the Python API runs under, as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest("sql", 1, "/adapters/sql")`: the adapter named lora_name, read from lora_path (a PEFT
    directory or a GGUF LoRA file) the first time a request names it. lora_int_id is vLLM's id for it (a
    positive integer); llmpipe keys adapters by name."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
