"""Quantized linear layers: drop-in twins of `llmpipe.layers.linear.Linear` holding INT8 or INT4 weights.

Decode (up to KERNEL_MAX_BATCH rows) runs the fused dequantize-matmul kernels of
`llmpipe.kernels.ops`, which read 4 or 8 bits per weight instead of 32 — decode is bound by
those bytes. Larger batches (prefill) are compute-bound: they dequantize the weight and run the
float GEMM. Either way the result is the float model's with the dequantized weight, to float32
rounding. With activation quantization (integer dots), batches of 2 or more rows take the panel
kernels instead (`ops.int4_gemm_dot` / `int8_gemm_dot`): the same function as the row
kernels', every weight byte read once for a batch and used for four rows at a time.

Stacked layers (q/k/v, gate/up) receive their checkpoint tensors one shard at a time; quantized
rows are staged until every shard has arrived and then packed once.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.kernels import huge_pages
from llmpipe.layers.linear import linear
from llmpipe.kernels import ops
from llmpipe.quant.formats import Q5_0_BLOCK, GGMLWeight, Int4Weight, Int8Weight, Q5_0Weight, QuantizedWeight
from llmpipe.quant.rtn import quantize_int4, quantize_int8

CHUNK = ops.CHUNK
# Up to this many rows, the kernel runs on slices of ops.MAX_ROWS (reading the weight once per
# slice); above it, dequantizing once and running the float GEMM is faster (`llmpipe bench latency`).
KERNEL_MAX_BATCH = 32
# With a float copy of the weights (EngineConfig.float_batch_weights), this many rows or more go to
# the float GEMM. Below it the fused decode step on the codes wins; above it the row kernels,
# which spend as long unpacking codes as multiplying, fall behind (SmolLM2 Q4_1, 2 threads, decode
# tok/s codes vs float copy: 8 rows 104 vs 101, 16 rows 104 vs 119, 32 rows 106 vs 209; a
# 128-token prefill 445 vs 270 ms).
FLOAT_BATCH_MIN_ROWS = 16
# With activation quantization, batches of PANEL_MIN_ROWS or more take the panel ops. SmolLM2's
# gate_up (INT4, 3072 x 576), 2 threads, AVX2, GFLOP/s at 4 / 32 / 256 / 2048 rows: panels 87 / 105 /
# 106 / 97 with 16-bit blocks, 150 / 181 / 180 / 186 with 8-bit; the row kernels (16-bit) 35 / 42 / - /
# -; dequantize + float GEMM 2 / 24 / 87 / 88. Its LM head (INT8, 49152 x 576, 16-bit blocks as int16
# multiply-adds) at 16 / 32 rows: panels 103 / 106, row kernels 60 / 76.
PANEL_MIN_ROWS = 2
# Batches the per-op integer-dot kernels take outside an engine step (`decode_numerics`), per
# activation bits (None: any). With 16-bit blocks (the default) a text scored past KERNEL_MAX_BATCH
# rows (`engine.score`, prompt logprobs, `llmpipe eval`) takes the exact float GEMM, as the exact path
# does. 8-bit blocks are approximate anyway and take the panels (1.5-2x the float GEMM) always.
PANEL_MAX_ROWS = {16: KERNEL_MAX_BATCH, 8: None}
# Inside an engine step every row takes the integer kernels (see decode_numerics).
_DECODE_NUMERICS = contextvars.ContextVar("llmpipe_decode_numerics", default=False)


@contextmanager
def decode_numerics(on: bool = True) -> Iterator[None]:
    """Inside (with on), layers with activation quantization compute batches of any size with the
    integer kernels: an engine step's rows, prefill chunks and the positions it samples from alike, so
    a token's numerics do not depend on how many rows share its step or how a prompt was chunked.
    With 16-bit blocks that is the exact function to float32 rounding (SmolLM2: perplexity 33.3678
    against 33.3680), and the panels outrun the float GEMM at every batch size measured (Zen 4 VNNI,
    2 threads, 128 rows: 179-246 against 102-154 GFLOP/s; 2,048 rows: level; AVX2: level)."""
    token = _DECODE_NUMERICS.set(on)
    try:
        yield
    finally:
        _DECODE_NUMERICS.reset(token)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


PACK_CHUNK_BYTES = 16 << 20  # codes packed at a time: temporaries stay this size, not a whole LM head's


def _shard_rows(shards: list, out_features: int) -> Iterator[tuple[int, QuantizedWeight]]:
    """(first row in the layer, shard): shards are written in place, never concatenated first."""
    row = 0
    for shard in shards:
        yield row, shard
        row += shard.shape[0]
    if row != out_features:
        raise ValueError(f"shards hold {row} rows, the layer {out_features}")


def _apply_groups(q: torch.Tensor, group_size: int, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, K] × scale[rows, g] (+ offset[rows, g]) per group of group_size columns; the last
    group may be narrower."""
    width, pad = q.shape[1], scale.shape[1] * group_size - q.shape[1]
    groups = (F.pad(q, (0, pad)) if pad else q).unflatten(1, (-1, group_size))
    w = groups * scale[..., None]
    if offset is not None:
        w += offset[..., None]
    return w.flatten(1)[:, :width]


def _int8_float(q: torch.Tensor, scale: torch.Tensor, group_size: int, in_c: bool) -> torch.Tensor:
    """INT8 codes times their group scales as float: one C pass, or PyTorch's ops (the same values)."""
    return ops.int8_dequantize(q, scale, group_size) if in_c else _apply_groups(q.float(), group_size, scale)


class QuantizedLinear(nn.Module):
    """Common part: shapes, bias, shard staging, the kernel-or-GEMM choice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # Kernel layout: K padded to whole 32-element chunks (zeros in x meet the padding); the last
        # group may be narrower than group_size (SmolLM2's 576 inputs at g128: 4 groups of 128, one of 64).
        self.group_size = group_size or _round_up(in_features, CHUNK)
        self.padded_in = _round_up(in_features, CHUNK)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shard_sizes: tuple[int, ...] = (out_features,)
        self._staged: dict[int, QuantizedWeight] = {}
        # 8 or 16: rows are quantized to blocks of that many bits and meet the codes in integer dot
        # products (set by quant.apply.quantize_activations); None: float activations (exact).
        self.activation_bits: int | None = None
        # True: batches of any size take the integer kernel too (evaluating the decode numerics at
        # every position: `llmpipe eval ... --quantized-prefill`); False: past KERNEL_MAX_BATCH rows
        # the float GEMM, as the exact path.
        self.quantized_prefill = False
        self.float_weight: torch.Tensor | None = None  # kernel_weight() kept, for batches (keep_float_copy)
        # the codes as the batched kernels' panels (ops.int4_panels / int8_panels), made on first use
        self.register_buffer("panels", None, persistent=False)

    def keep_float_copy(self) -> None:
        """Keep the weight dequantized too: batches of FLOAT_BATCH_MIN_ROWS rows or more use it."""
        self.float_weight = self.kernel_weight().float().contiguous()

    @property
    def num_groups(self) -> int:
        return -(-self.padded_in // self.group_size)

    def load_shard(self, shard: int | None, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Take one checkpoint tensor (float: quantized here; or already quantized) for rows `shard`."""
        self._staged[shard or 0] = self.quantize(tensor) if isinstance(tensor, torch.Tensor) else tensor
        if len(self._staged) == len(self.shard_sizes):
            shards = [self._staged.pop(i) for i in range(len(self.shard_sizes))]
            self.pack(shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.kernel_input(x)
        # Float activations: batches past KERNEL_MAX_BATCH rows (prefill chunks) take the float GEMM,
        # several times faster than the row kernels run MAX_ROWS rows at a time. Activation
        # quantization: the integer kernels for any batch in an engine step (decode_numerics), else up
        # to PANEL_MAX_ROWS (the panels read each weight once).
        every_row = (self.quantized_prefill or _DECODE_NUMERICS.get()) and self.activation_bits is not None
        if self.float_weight is not None and x.shape[0] >= FLOAT_BATCH_MIN_ROWS and not every_row:
            return linear(x.float(), self.float_weight, self.bias).to(x.dtype)
        rows = x.shape[0]
        kernel_rows = every_row or rows <= KERNEL_MAX_BATCH or self._dot_takes(rows)
        if not kernel_rows or x.device.type != "cpu" or not ops.available():
            return linear(x, self.kernel_weight().to(x.dtype), self.bias)
        # Decode runs this once per linear per step: no op that is not needed (batch 1, float32: none).
        wide = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = self.panel_kernel(wide) if self.takes_panels(rows) else self.kernel(wide)  # any rows, none included
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _dot_takes(self, rows: int) -> bool:
        """Whether the integer-dot kernels take a batch this big (past the exact kernels' KERNEL_MAX_BATCH)."""
        if self.activation_bits is None:
            return False
        limit = PANEL_MAX_ROWS[self.activation_bits]
        return limit is None or rows <= limit

    def takes_panels(self, rows: int) -> bool:
        """Whether a batch of `rows` the kernels take goes to panel_kernel (with activation quantization)."""
        return self.activation_bits is not None and rows >= PANEL_MIN_ROWS

    def batch_panels(self) -> torch.Tensor:
        """The weight as the batched kernels' panels (made once, then kept: about as many bytes again as
        the codes and scales)."""
        if self.panels is None:
            self.panels = huge_pages.moved(self.make_panels())
        return self.panels

    def make_panels(self) -> torch.Tensor:
        raise NotImplementedError

    def panel_kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.padded_in == self.in_features else F.pad(x, (0, self.padded_in - self.in_features))

    def dequantize(self) -> torch.Tensor:
        """Float weight [out, in] in the checkpoint's column order."""
        return self.kernel_weight()[:, : self.in_features]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float: the lookup of an embedding tied to this (LM head) weight."""
        return self.kernel_weight(ids)[:, : self.in_features]

    def _check_group(self, shards: list, group_size: int | None, per_row_ok: bool = False) -> None:
        allowed = {group_size, None} if per_row_ok and group_size == self.padded_in else {group_size}
        if any(s.group_size not in allowed for s in shards):
            raise ValueError(f"{type(self).__name__}: shards must have group size {group_size}")

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        raise NotImplementedError

    def pack(self, shards: list) -> None:
        raise NotImplementedError

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight [out (or rows), padded_in] the kernel multiplies kernel_input(x) by."""
        raise NotImplementedError

    def _dequantizes_in_c(self) -> bool:
        """Whether the weight (or an embedding lookup's rows) dequantizes in one C pass (ops.int4_dequantize
        / int8_dequantize: PyTorch's values, without its passes over a float copy per operation): CPU
        buffers, the library built."""
        return self.scale.device.type == "cpu" and ops.available()


class Int8Linear(QuantizedLinear):
    """Symmetric INT8: w = q * scale[row, group]; one group per row unless group_size is set (Q8_0: 32)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = None):
        super().__init__(in_features, out_features, bias, group_size)
        self.register_buffer("q", torch.empty(out_features, self.padded_in, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, self.num_groups))

    def quantize(self, w: torch.Tensor) -> Int8Weight:
        if self.group_size != self.padded_in:
            raise ValueError("float weights quantize to per-channel int8 only; grouped int8 comes from GGUF Q8_0")
        return quantize_int8(w)

    def pack(self, shards: list[Int8Weight | Q5_0Weight]) -> None:
        # A per-channel shard (group_size None) is one group spanning the (padded) row. Q5_0 shards (a
        # stacked layer mixing Q5_0 and Q8_0 tensors) hold their codes as int8.
        shards = [s.to_int8() if isinstance(s, Q5_0Weight) else s for s in shards]
        self._check_group(shards, self.group_size, per_row_ok=True)
        for row, s in _shard_rows(shards, self.out_features):
            rows = slice(row, row + s.q.shape[0])
            self.q[rows, : s.q.shape[1]].copy_(s.q)
            self.q[rows, s.q.shape[1] :].zero_()
            self.scale[rows].copy_(s.scale.reshape(s.q.shape[0], -1))
        self.panels = None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_bits:
            return ops.int8_linear_dot(x, self.q, self.scale, self.group_size, self.activation_bits)
        return ops.int8_linear(x, self.q, self.scale, self.group_size)

    def make_panels(self) -> torch.Tensor:
        return ops.int8_panels(self.q, self.scale, self.group_size)

    def panel_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_gemm_dot(x, self.batch_panels(), self.out_features, self.activation_bits)

    def kernel_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        return _int8_float(q, scale, self.group_size, self._dequantizes_in_c())


class Int4Linear(QuantizedLinear):
    """Group-wise asymmetric INT4: w = q * scale[row, group] + offset[row, group], two codes a byte
    (per 32-element chunk: element j in the low nibble of byte j, element j + 16 in the high one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128):
        super().__init__(in_features, out_features, bias, group_size)
        self.register_buffer("codes", torch.empty(out_features, self.padded_in // 2, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(out_features, self.num_groups))
        self.register_buffer("offset", torch.empty(out_features, self.num_groups))
        self.register_buffer("in_perm", None)  # GPTQ act-order: the kernel reads x[:, in_perm]

    def quantize(self, w: torch.Tensor) -> Int4Weight:
        return quantize_int4(w, self.group_size)

    def pack(self, shards: list[Int4Weight]) -> None:
        self._check_group(shards, self.group_size)
        perms = {None if s.in_perm is None else tuple(s.in_perm.tolist()) for s in shards}
        if len(perms) > 1:
            raise ValueError("stacked int4 shards must share one act-order permutation")
        step = max(1, PACK_CHUNK_BYTES // self.padded_in)
        for row, s in _shard_rows(shards, self.out_features):
            for start in range(0, s.q.shape[0], step):
                self._pack_codes(row + start, s.q[start : start + step])
            self.scale[row : row + s.q.shape[0]].copy_(s.scale)
            self.offset[row : row + s.q.shape[0]].copy_(s.offset)
        if shards[0].in_perm is not None:
            self.in_perm = shards[0].in_perm.to(self.codes.device)
        self.panels = None

    def _pack_codes(self, row: int, q: torch.Tensor) -> None:
        chunks = F.pad(q, (0, self.padded_in - q.shape[1])).view(q.shape[0], -1, 2, CHUNK // 2)
        self.codes[row : row + q.shape[0]].copy_((chunks[:, :, 0] | (chunks[:, :, 1] << 4)).flatten(1))

    def kernel_input(self, x: torch.Tensor) -> torch.Tensor:
        return super().kernel_input(x if self.in_perm is None else x.index_select(1, self.in_perm))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_bits:
            return ops.int4_linear_dot(x, self.codes, self.scale, self.offset, self.group_size, self.activation_bits)
        return ops.int4_linear(x, self.codes, self.scale, self.offset, self.group_size)

    def make_panels(self) -> torch.Tensor:
        return ops.int4_panels(self.codes, self.scale, self.offset, self.group_size)

    def panel_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int4_gemm_dot(x, self.batch_panels(), self.out_features, self.activation_bits)

    def kernel_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes, scale, offset = (self.codes, self.scale, self.offset) if rows is None else (
            self.codes[rows], self.scale[rows], self.offset[rows]
        )
        if self._dequantizes_in_c():
            return ops.int4_dequantize(codes, scale, offset, self.group_size)
        chunks = codes.view(codes.shape[0], -1, CHUNK // 2)
        q = torch.stack([chunks & 15, chunks >> 4], dim=2).flatten(1).float()
        return _apply_groups(q, self.group_size, scale, offset)

    def dequantize(self) -> torch.Tensor:
        w = super().dequantize()
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = super().embed(ids)
        return w if self.in_perm is None else w[:, torch.argsort(self.in_perm)]


class Q5_0Linear(QuantizedLinear):
    """GGUF Q5_0 weights as the file's blocks (formats.Q5_0Weight): the row kernels stream them and unpack
    each row to Int8Linear's codes and scales, so every result is Int8Linear's on the same weight, bit for
    bit; the panels and the dequantized weight are made from the unpacked codes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = Q5_0_BLOCK):
        if in_features % Q5_0_BLOCK or group_size != Q5_0_BLOCK:
            raise ValueError(f"Q5_0 weights need whole blocks of {Q5_0_BLOCK} inputs, got {in_features} (group {group_size})")
        super().__init__(in_features, out_features, bias, Q5_0_BLOCK)
        blocks = torch.empty(out_features, Q5_0Weight.bytes_per_row(in_features), dtype=torch.uint8)
        self.register_buffer("blocks", blocks)

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        raise ValueError("Q5_0 weights come from GGUF files; float weights quantize to int8 or int4")

    def pack(self, shards: list[Q5_0Weight]) -> None:
        for row, s in _shard_rows(shards, self.out_features):
            self.blocks[row : row + s.blocks.shape[0]].copy_(s.blocks)
        self.panels = None

    def int8_form(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes q - 16 int8 [out (or rows), in], scales float32 [out (or rows), in / 32]): Int8Linear's q and scale."""
        blocks = self.blocks if rows is None else self.blocks[rows]
        if self._dequantizes_in_c():
            return ops.q5_0_unpack(blocks)
        weight = Q5_0Weight(blocks).to_int8()
        return weight.q, weight.scale

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_bits:
            return ops.q5_0_linear_dot(x, self.blocks, self.activation_bits)
        return ops.q5_0_linear(x, self.blocks)

    def make_panels(self) -> torch.Tensor:
        return ops.int8_panels(*self.int8_form(), self.group_size)

    def panel_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_gemm_dot(x, self.batch_panels(), self.out_features, self.activation_bits)

    def kernel_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return _int8_float(*self.int8_form(rows), self.group_size, self._dequantizes_in_c())

    def _dequantizes_in_c(self) -> bool:
        return self.blocks.device.type == "cpu" and ops.available()


# Rows of a weight dequantized at a time where the float path takes a GGML weight: temporaries stay small.
DEQUANTIZE_ROWS = 1024


class GGMLLinear(QuantizedLinear):
    """A GGUF file's own quantized blocks (formats.GGMLWeight), used where they lie: each shard (q, k and v of a
    stacked layer, gate and up) is a segment of rows of one type, held as the tensor the loader gave — a view of
    the file's mapping, so loading copies nothing and the weights are the page cache's pages (shards the loader
    had to rewrite, such as q and k's rows unpermuted, are its copies). The kernels (`ops.ggml_linear_dot`)
    stream the blocks with integer dot products against activation blocks of `activation_bits` (any batch: one
    pass over the weight per call); a stacked layer may mix types (a Q4_K_M file keeps some layers' v in Q6_K).
    Float activations (`activation_bits` None) take the dequantized weight, gguf-py's values, a slice of rows
    at a time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = None):
        if in_features % CHUNK:
            raise ValueError(f"GGUF block weights need whole blocks of {CHUNK} inputs, got {in_features}")
        super().__init__(in_features, out_features, bias, None)
        self.register_buffer("placement", torch.empty(0, dtype=torch.uint8), persistent=False)  # the segments' device
        self.segment_types: list[int] = []  # ggml type of buffer segment{i}, in row order
        self._table: tuple[tuple[int, ...], torch.Tensor] = ((), torch.empty(0, dtype=torch.int64))

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        raise ValueError("GGUF block weights come from GGUF files; float weights quantize to int8 or int4")

    def pack(self, shards: list[GGMLWeight]) -> None:
        for i in range(len(self.segment_types)):
            delattr(self, f"segment{i}")
        self.segment_types = []
        for i, (_, s) in enumerate(_shard_rows(shards, self.out_features)):
            blocks = s.blocks.to(self.placement.device)
            self.register_buffer(f"segment{i}", blocks if blocks.is_contiguous() else blocks.contiguous())
            self.segment_types.append(s.ggml_type)

    def segment_blocks(self) -> list[tuple[int, torch.Tensor]]:
        """(ggml type, uint8 [rows, bytes per row]) per segment, in row order."""
        return [(t, getattr(self, f"segment{i}")) for i, t in enumerate(self.segment_types)]

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """(ggml type, rows, address of the first byte) per segment."""
        return [(t, b.shape[0], b.data_ptr()) for t, b in self.segment_blocks()]

    @property
    def segment_table(self) -> torch.Tensor:
        """`segments` as int64 [n, 3], the fused decode step's (made again only where a segment moved)."""
        key = tuple(getattr(self, f"segment{i}").data_ptr() for i in range(len(self.segment_types)))
        if self._table[0] != key:  # every forward asks: the table itself is made only when a segment moved
            self._table = (key, torch.tensor(self.segments, dtype=torch.int64).reshape(-1, 3))
        return self._table[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_bits is None or x.device.type != "cpu" or not ops.available():
            return self._float_forward(x)
        wide = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        flat = wide.reshape(-1, self.in_features)
        y = ops.ggml_segments_dot(flat, self.segment_table, self.out_features, self.activation_bits)
        y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = []
        for start in range(0, self.out_features, DEQUANTIZE_ROWS):
            rows = torch.arange(start, min(start + DEQUANTIZE_ROWS, self.out_features))
            parts.append(F.linear(x, self.kernel_weight(rows).to(x.dtype)))
        y = torch.cat(parts, dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def takes_panels(self, rows: int) -> bool:
        return False  # the row kernels read each weight once per call at any batch

    def kernel_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 [out (or len(rows)), in]: gguf-py's dequantization of those rows (an embedding lookup's)."""
        pieces, places, first_row = [], [], 0
        for ggml_type, blocks in self.segment_blocks():
            count = blocks.shape[0]
            if rows is None:
                pieces.append(GGMLWeight(ggml_type, blocks).dequantize())
            else:
                inside = torch.nonzero((rows >= first_row) & (rows < first_row + count)).flatten()
                if len(inside):  # a slice of rows may miss a segment (gguf-py's dequantize takes no empty rows)
                    pieces.append(GGMLWeight(ggml_type, blocks[rows[inside] - first_row]).dequantize())
                    places.append(inside)
            first_row += count
        if len(pieces) == 1:
            return pieces[0]
        if rows is None:
            return torch.cat(pieces)
        out = torch.empty(len(rows), self.in_features)
        out[torch.cat(places)] = torch.cat(pieces)
        return out


def stacked_linear(x: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
    """x @ the layers' weights stacked by rows (+ their biases): [..., Σ out]. GGUF block weights (GGMLLinear)
    take one kernel call over all their segments, x quantized once (a token's experts' gate_up); others one each."""
    first = layers[0]
    bits = getattr(first, "activation_bits", None)
    if (bits is None or x.device.type != "cpu" or not ops.available()
            or any(type(m) is not GGMLLinear or m.activation_bits != bits or (m.bias is None) != (first.bias is None)
                   for m in layers)):
        return torch.cat([m(x) for m in layers], dim=-1)
    wide = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    table = torch.cat([m.segment_table for m in layers])
    y = ops.ggml_segments_dot(wide.reshape(-1, first.in_features), table, sum(m.out_features for m in layers), bits)
    if first.bias is not None:  # biased experts (gpt-oss)
        y += torch.cat([m.bias for m in layers]).float()
    return y.view(*x.shape[:-1], -1).to(x.dtype)
