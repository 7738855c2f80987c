"""Serving several LoRA adapters over one base model: `LoRAManager` loads adapters into slots and, for a step
whose rows name adapters, adds each row's low-rank delta to the base layers' outputs.

The model is never rewritten: whatever its linear layers are (float `Linear`, INT8/INT4, GGUF blocks), the delta
is added to their output by forward hooks that exist only inside a step that has adapter rows, so a base-only
step runs exactly the code it ran without a manager. Such a step also turns the whole-stack fused decode call
off (it runs every linear inside C, where no hook sees it) for the layer-by-layer path.

    manager = LoRAManager(llm.engine.model, max_loras=4, max_lora_rank=16)
    manager.load("sql", "adapters/sql")                  # a PEFT directory, or a llama.cpp .gguf LoRA
    with manager.step(["sql", None, "sql"]):             # one entry per row of the next forward
        hidden = model(...)
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from typing import Collection, Iterator, Sequence

import torch
from torch import nn

from llmpipe.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from llmpipe.lora.adapter import LoRAAdapter
from llmpipe.lora.batch import LoRABatch
from llmpipe.lora.gguf_adapter import read_gguf_adapter
from llmpipe.lora.peft_adapter import PICKLED, read_peft_adapter
from llmpipe.lora.slots import ModuleSlots
from llmpipe.lora.targets import LoRATargets
from llmpipe.models.llama.decode_step import PANEL_MAX_BATCH, FusedDecodeBody


def read_adapter(name: str, path: str | Path, targets: LoRATargets) -> LoRAAdapter:
    """A PEFT directory (or its adapter_model.safetensors) or a GGUF LoRA file, for the model `targets` describes."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such LoRA adapter file or directory")
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf_adapter(name, path, targets)
    if path.is_file() and path.name == PICKLED:
        raise UnsupportedModelError(f"{path}: a pickle, which llmpipe never loads; save the adapter as safetensors")
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent
    if not path.is_dir():
        raise UnsupportedModelError(f"{path}: not a PEFT adapter directory or a GGUF LoRA file")
    return read_peft_adapter(name, path, targets)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int = 4, max_lora_rank: int = 16, dtype: torch.dtype = torch.float32):
        if max_loras < 1 or max_lora_rank < 1:
            raise InvalidRequestError("max_loras and max_lora_rank must be at least 1", param="max_loras")
        self.model, self.max_loras, self.max_lora_rank, self.dtype = model, max_loras, max_lora_rank, dtype
        self.targets = LoRATargets(model, max_lora_rank)
        self.device = next(iter(model.buffers()), next(model.parameters())).device
        self.slots: dict[str, ModuleSlots] = {}  # made for a module when the first adapter changing it loads
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: dict[str, int] = {}
        self._bodies = [m for m in model.modules() if isinstance(m, FusedDecodeBody)]
        # Each row's slot (-1: base) for the fused decode step, which reads it through every module's LoraDesc.
        self.row_slot = torch.full((PANEL_MAX_BATCH,), -1, dtype=torch.int64)
        self._in_step = False

    def names(self) -> list[str]:
        return list(self.adapters)

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read an adapter file and take a free slot for it; returns the adapter as read."""
        self.check_free(name)
        adapter = read_adapter(name, path, self.targets)
        self.add(adapter)
        return adapter

    def add(self, adapter: LoRAAdapter) -> int:
        """Put an adapter (already read for this model) into a free slot; returns the slot."""
        self.check_free(adapter.name)
        if adapter.rank > self.max_lora_rank:
            raise InvalidRequestError(f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank "
                                      f"{self.max_lora_rank}", param="max_lora_rank")
        slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        for module_name, factors in adapter.modules.items():
            if module_name not in self.slots:
                module = self.targets.modules[module_name]
                width = self.max_lora_rank * self.targets.shard_count(module_name)
                slots = ModuleSlots(self.max_loras, width, module.in_features, module.out_features, self.dtype,
                                    self.device, self.row_slot)
                self.slots[module_name] = slots
                module.lora_desc = slots.desc  # what the fused decode step reads (None: it leaves the step to layers)
                for body in self._bodies:
                    body.reset_decode_step()  # its descriptors now point at this module's slots
            self.slots[module_name].set(slot, factors)
        self.adapters[adapter.name], self.slot_of[adapter.name] = adapter, slot
        return slot

    def make_resident(self, adapter: LoRAAdapter, in_use: Collection[str]) -> bool:
        """adapter in a slot (a step may read it): already there, or in a free slot, or in the slot of the least
        recently used adapter not `in_use` (which leaves; its factors stay with whoever read them). False where
        every slot holds an adapter in use."""
        if adapter.name in self.slot_of:
            self.adapters[adapter.name] = self.adapters.pop(adapter.name)  # most recently used last
            return True
        if len(self.slot_of) >= self.max_loras:
            victim = next((name for name in self.adapters if name not in in_use), None)
            if victim is None:
                return False
            self.unload(victim)
        self.add(adapter)
        return True

    def unload(self, name: str) -> None:
        if self._in_step:
            raise InvalidRequestError("adapters cannot be unloaded during a step")
        if name not in self.adapters:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="lora")
        slot = self.slot_of.pop(name)
        del self.adapters[name]
        for slots in self.slots.values():
            slots.clear(slot)

    def batch(self, row_adapters: Sequence[str | None], counts: Sequence[int] | None = None) -> LoRABatch:
        """The step's row → slot grouping; row_adapters gives each row's adapter (None: the base model), or
        with `counts` each sequence's, repeated over its count of rows."""
        unknown = {a for a in row_adapters if a is not None and a not in self.slot_of}
        if unknown:
            raise InvalidRequestError(f"no LoRA adapter named {sorted(unknown)[0]!r} is loaded", param="lora")
        slots = [None if a is None else self.slot_of[a] for a in row_adapters]
        if counts is not None:
            slots = [s for s, n in zip(slots, counts, strict=True) for _ in range(n)]
        return LoRABatch(slots, self.device)

    @contextmanager
    def step(self, row_adapters: Sequence[str | None], counts: Sequence[int] | None = None) -> Iterator[LoRABatch]:
        """Inside: the model's forwards add each row's adapter delta (see `batch` for the arguments). A step
        without adapter rows changes nothing."""
        if self._in_step:
            raise InvalidRequestError("LoRA steps do not nest")
        batch = self.batch(row_adapters, counts)
        active = {slot for slot, _ in batch.groups}
        changed = [(name, slots) for name, slots in self.slots.items() if any(slots.widths[s] for s in active)]
        # The layer path adds the deltas through hooks; the fused decode step reads row_slot through each changed
        # module's LoraDesc, and is left to the layers where one has none (factors not float32 on the CPU).
        hooks = [self.targets.modules[name].register_forward_hook(functools.partial(_add_delta, batch, slots))
                 for name, slots in changed]
        rows = min(batch.rows, len(self.row_slot))  # a step with more rows is never a fused one
        if changed:
            self.row_slot[:rows] = torch.tensor(batch.slot_of_row[:rows], dtype=torch.int64)
        self._in_step = True
        for body in self._bodies if any(slots.desc is None for _, slots in changed) else ():
            body.lora_active = True
        try:
            yield batch
        finally:
            for hook in hooks:
                hook.remove()
            self.row_slot[:rows] = -1
            for body in self._bodies:
                body.lora_active = False
            self._in_step = False

    def check_free(self, name: str) -> None:
        """InvalidRequestError where `name` is taken or no slot is free."""
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora")
        if len(self.adapters) >= self.max_loras:
            raise InvalidRequestError(f"all {self.max_loras} LoRA slots (max_loras) hold adapters; unload one first",
                                      param="max_loras")


def _add_delta(batch: LoRABatch, slots: ModuleSlots, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return batch.add_delta(output, args[0], slots)
