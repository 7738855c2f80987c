"""Loading a GGUF without copies beyond the one into the model: quantized tensors never pass through float32,
int4 codes pack a few rows at a time, and each tensor's mapped pages are let go once it has been copied."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmpipe import LLM
from llmpipe.loader import gguf_quants, load_checkpoint
from llmpipe.loader.gguf_weights import NATIVE_FORMATS
from llmpipe.models.weights import EMBED
from llmpipe.quant import formats, linear
from llmpipe.quant.linear import GGMLLinear, Int4Linear
from llmpipe.quant.rtn import quantize_int4
from tests.loader.test_gguf_quants import random_weights

# Every stacked group in one format, so these layers stay quantized (the embedding stays float, and
# down_proj: its 112 inputs are no whole blocks).
UNIFORM = {
    **{f"model.layers.0.self_attn.{p}_proj.weight": Q.Q8_0 for p in "qkv"},
    **{f"model.layers.0.mlp.{p}_proj.weight": Q.Q4_0 for p in ("gate", "up")},
    "model.layers.0.self_attn.o_proj.weight": Q.Q5_0,
    **{f"model.layers.1.self_attn.{p}_proj.weight": Q.Q4_0 for p in "qkv"},
    **{f"model.layers.1.mlp.{p}_proj.weight": Q.Q8_0 for p in ("gate", "up")},
    "model.layers.1.self_attn.o_proj.weight": Q.Q4_1,
    "lm_head.weight": Q.Q8_0,
}


def _refuse(*args, **kwargs):
    raise AssertionError("a tensor that stays quantized was dequantized at load")


def test_tensors_that_stay_quantized_are_never_dequantized_at_load(tiny_gguf, monkeypatch):
    path = str(tiny_gguf("llama_gqa", UNIFORM))
    for qtype in NATIVE_FORMATS:
        monkeypatch.setitem(gguf_quants.BLOCK_DEQUANTIZERS, qtype, _refuse)
    for weight in (formats.Int8Weight, formats.Int4Weight, formats.GGMLWeight):
        monkeypatch.setattr(weight, "dequantize", _refuse)
    monkeypatch.setattr(linear.QuantizedLinear, "keep_float_copy", _refuse)
    model = LLM(path, progress=False).engine.model
    layers = model.model.layers
    for module in (*(getattr(layer.self_attn, p) for layer in layers for p in ("qkv_proj", "o_proj")),
                   *(layer.mlp.gate_up_proj for layer in layers), model.lm_head):
        assert isinstance(module, GGMLLinear)


def test_stacked_int4_shards_packed_a_few_rows_at_a_time_are_packed_whole(monkeypatch):
    first, second = (quantize_int4(torch.from_numpy(random_weights(seed)), 32) for seed in (0, 1))
    out, in_features = first.shape[0] * 2, first.shape[1]
    layers = [Int4Linear(in_features, out, group_size=32) for _ in "ab"]
    for layer in layers:
        layer.shard_sizes = (first.shape[0], second.shape[0])
    layers[0].load_shard(0, first), layers[0].load_shard(1, second)
    monkeypatch.setattr(linear, "PACK_CHUNK_BYTES", layers[1].padded_in * 5)
    layers[1].load_shard(0, first), layers[1].load_shard(1, second)
    assert torch.equal(layers[0].codes, layers[1].codes)
    assert torch.equal(layers[1].dequantize(), torch.cat([first.dequantize(), second.dequantize()]))


class RecordingMap:
    """Stands in for the reader's mmap: records madvise calls, passes them on."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping, self.calls = mapping, []

    def __len__(self) -> int:
        return len(self.mapping)

    def madvise(self, advice: int, start: int, length: int) -> None:
        self.calls.append((advice, start, length))
        self.mapping.madvise(advice, start, length)


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED"), reason="no madvise(MADV_DONTNEED) here")
def test_each_tensors_pages_are_let_go_once_the_next_is_asked_for_and_read_back_intact(tiny_gguf):
    checkpoint = load_checkpoint(str(tiny_gguf("llama_gqa", UNIFORM)))
    source = checkpoint.source
    reader = source._reader
    recording = reader.mapping = RecordingMap(reader.mapping)
    seen = []
    for name, tensor in checkpoint.iter_weights():
        assert len(recording.calls) == len(seen)  # the tensors before this one let go, not this one yet
        dense = tensor.dequantize() if not isinstance(tensor, torch.Tensor) else tensor.clone()
        seen.append((name, source._tensors[name], dense))
    assert len(recording.calls) == len(seen)
    for (advice, start, length), (_, info, _) in zip(recording.calls, seen):
        assert advice == mmap.MADV_DONTNEED and start % mmap.PAGESIZE == 0
        assert start <= info.data_offset and info.data_offset + info.n_bytes <= start + length
    # The map is private and never written: pages let go fault back in from the file, unchanged.
    reread = dict(checkpoint.iter_weights())
    for name, _, before in seen:
        after = reread[name]
        assert torch.equal(before, after.dequantize() if not isinstance(after, torch.Tensor) else after), name


def _advice_on(recording: RecordingMap, info) -> set[int]:
    return {a for a, start, length in recording.calls
            if start <= info.data_offset and info.data_offset + info.n_bytes <= start + length}


def test_blocks_kept_as_the_files_bytes_are_views_of_the_mapping_read_in_and_never_let_go(tiny_gguf):
    """A GGML tensor the model keeps is its view of the mapping (no copy): its pages are read in at load and
    stay; every other tensor's pages go once copied (q and k: rows unpermuted into a copy of their own)."""
    checkpoint = load_checkpoint(str(tiny_gguf("llama_gqa", UNIFORM)))
    source = checkpoint.source
    reader = source._reader
    recording = reader.mapping = RecordingMap(reader.mapping)
    weights = dict(checkpoint.iter_weights(plan=checkpoint.quant_plan("auto", 128)))
    kept = {name for name, w in weights.items() if isinstance(w, formats.GGMLWeight) and name not in source._heads}
    assert "model.layers.0.self_attn.v_proj.weight" in kept and "model.layers.0.self_attn.q_proj.weight" not in kept
    for name, w in weights.items():
        shares = isinstance(w, formats.GGMLWeight) and np.shares_memory(w.blocks.numpy(), reader.data)
        assert shares == (name in kept), name
        assert (mmap.MADV_DONTNEED in _advice_on(recording, source._tensors[name])) == (name not in kept), name


def _kept_embedding_advice(path: str) -> tuple[set[int], set[int]]:
    """(the madvise calls on the embedding's bytes, those on a layer's kept blocks) while the model's plan is read."""
    checkpoint = load_checkpoint(path)
    source = checkpoint.source
    recording = source._reader.mapping = RecordingMap(source._reader.mapping)
    weights = dict(checkpoint.iter_weights(plan=checkpoint.quant_plan("auto", 128)))
    assert isinstance(weights[EMBED], formats.GGMLWeight)
    layer = next(name for name in weights if ".layers." in name and name not in source._heads
                 and isinstance(weights[name], formats.GGMLWeight))
    return _advice_on(recording, source._tensors[EMBED]), _advice_on(recording, source._tensors[layer])


POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


@pytest.mark.skipif(not hasattr(mmap, "MADV_WILLNEED"), reason="no madvise(MADV_WILLNEED) here")
def test_an_untied_embedding_is_read_into_the_page_cache_but_mapped_only_where_tokens_look_it_up(tiny_gguf):
    """Only the rows tokens look up join the RSS (an 8B's untied 0.27 GiB of Q4_K, a gpt-oss's 0.57 GiB of Q8_0):
    its pages are read ahead into the page cache (WILLNEED), never mapped ahead (POPULATE_READ) as a matrix's are."""
    path = str(tiny_gguf("llama_gqa", UNIFORM | {EMBED: Q.Q8_0}))
    assert not load_checkpoint(path).config.tie_word_embeddings
    embedding, layer = _kept_embedding_advice(path)
    assert embedding == {mmap.MADV_WILLNEED}
    assert POPULATE_READ in layer or layer == {mmap.MADV_WILLNEED}  # a kernel before 5.14: WILLNEED alone


def test_an_embedding_that_is_also_the_lm_head_is_mapped_ahead_as_every_matrix(smollm2_gguf):
    """Tied, the embedding is the head every decode step streams whole: its pages are mapped at load."""
    assert load_checkpoint(str(smollm2_gguf)).config.tie_word_embeddings
    embedding, layer = _kept_embedding_advice(str(smollm2_gguf))
    assert embedding == layer and embedding & {POPULATE_READ, mmap.MADV_WILLNEED}


def test_an_untied_embedding_looked_up_from_its_unmapped_pages_gives_the_files_rows(tiny_gguf):
    path = str(tiny_gguf("llama_gqa", UNIFORM | {EMBED: Q.Q8_0}))
    checkpoint = load_checkpoint(path)
    rows = gguf_quants.dequantize(torch.from_numpy(checkpoint.source._tensors[EMBED].data), Q.Q8_0,
                                  tuple(checkpoint.source._tensors[EMBED].shape[::-1]))
    embed = LLM(path, progress=False).engine.model.model.embed_tokens
    ids = torch.tensor([0, 7, 3, 7, rows.shape[0] - 1])
    assert torch.equal(embed(ids), rows[ids].to(torch.float32))
