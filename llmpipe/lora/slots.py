"""The slot table: every loaded adapter's factors for one module, stacked and zero-padded, so adapters load
and unload at run time without touching the model.

Per module: a [max_loras, width, in] and bt [max_loras, width, out], width = max_lora_rank × the module's
shards (q, k and v of a stacked qkv_proj each have their own rank). B is kept transposed so that a slot's
first w rank columns are one contiguous block: a step multiplies by a[s, :w] and bt[s, :w] only, never by
the padding. `widths[s]` is 0 where slot s's adapter leaves the module alone (or the slot is empty).
"""

from __future__ import annotations

import torch

from llmpipe.lora.adapter import LoRAFactors


class ModuleSlots:
    def __init__(self, max_loras: int, width: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, row_slot: torch.Tensor | None = None):
        """row_slot: the manager's per-row slot table, which the fused decode step reads (None: no fused step)."""
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        self.widths = [0] * max_loras
        self.width_table = torch.zeros(max_loras, dtype=torch.int64)  # the widths, as the C step reads them
        # The fused decode step's LoraDesc (kernels/csrc/decode_step.c): float32 CPU factors only.
        self.desc = None if row_slot is None or dtype != torch.float32 or device.type != "cpu" else torch.tensor(
            [self.a.data_ptr(), self.bt.data_ptr(), self.width_table.data_ptr(), row_slot.data_ptr(), width],
            dtype=torch.int64)

    def set(self, slot: int, factors: LoRAFactors) -> None:
        w = factors.rank
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.a[slot, :w] = factors.a
        self.bt[slot, :w] = factors.b.T
        self.widths[slot] = w
        self.width_table[slot] = w

    def clear(self, slot: int) -> None:
        self.widths[slot] = 0  # the stale values past width 0 are never read
        self.width_table[slot] = 0

    def factors(self, slot: int) -> LoRAFactors | None:
        """What slot `slot` holds (None: nothing for this module), as the adapter gave it."""
        w = self.widths[slot]
        return LoRAFactors(self.a[slot, :w], self.bt[slot, :w].T) if w else None
