"""Qwen3.5 (dense, text) against transformers on a tiny random-weight checkpoint (float32), driven at the model
level: the per-layer caches (paged K/V for the full-attention layer, conv and SSM states for the three Gated
DeltaNet layers) and their metadata are built here by hand, as the engine builds them for a step. Whole and
chunked prefill, decode, a state snapshot partway through a chunk, and decode rows beside a prefill chunk in one
step; the config (and a multimodal checkpoint read as its text model) and the engine options refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe.config import EngineConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.kv_cache.kinds import FullAttentionSpec
from llmpipe.kv_cache.kinds.recurrent import RecurrentMetadata, RecurrentState, RecurrentStateSpec, StateChunk
from llmpipe.kv_cache.layout import kv_cache_specs
from llmpipe.layers.attention import AttentionMetadata, PrefillChunk
from llmpipe.loader import load_checkpoint
from llmpipe.loader.hf_config import hf_config_dict, hf_model_config
from llmpipe.models import build_model
from llmpipe.models.qwen3_5 import QWEN3_5
from llmpipe.models.registry import family_of
from tests.utils import prompt

BLOCK = 4  # tokens per K/V block: a prompt spans several
NUM_BLOCKS = 32
SLOTS = 6  # recurrent states in the pool
ATOL = 1e-4
PROMPT = prompt(24, seed=11)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded = load_checkpoint(str(checkpoint))
    return build_model(loaded.config, loaded.iter_weights(), torch.float32, "cpu")


@pytest.fixture(scope="module")
def reference(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@dataclass
class Seq:
    """A sequence's place in the caches: its recurrent state's slot, its K/V blocks, the tokens computed so far."""

    slot: int
    blocks: list[int]
    tokens: list[int]

    def kv_slots(self, start: int, count: int) -> list[int]:
        return [self.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + count)]


class Chunk(NamedTuple):
    seq: Seq
    tokens: list[int]
    snapshot: tuple[int, int] | None = None  # (tokens into the chunk, slot to copy the state to)


def fresh_caches(model) -> list:
    """Per layer what it reports: K/V blocks, or conv and SSM states holding garbage (stale states of finished
    sequences, which a sequence's first chunk must not read)."""
    cfg, generator = model.config, torch.Generator().manual_seed(3)
    caches = []
    for spec in kv_cache_specs(model):
        if isinstance(spec, RecurrentStateSpec):
            caches.append(RecurrentState(torch.randn(SLOTS, *spec.conv_shape, generator=generator),
                                         torch.randn(SLOTS, *spec.ssm_shape, generator=generator)))
        else:
            caches.append(torch.zeros(2, NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, cfg.head_dim))
    return caches


@torch.no_grad()
def step(model, caches: list, decodes: list[tuple[Seq, int]] = (), chunks: list[Chunk] = (),
         decode_snapshots: list[tuple[int, int]] = ()) -> torch.Tensor:
    """One forward: decode rows (a sequence and its next token) first, then prefill chunks → each row's logits."""
    ids, positions, kv_slots = [], [], []
    for seq, token in decodes:
        ids.append(token)
        positions.append(len(seq.tokens))
        kv_slots += seq.kv_slots(len(seq.tokens), 1)
    prefills, state_chunks = [], []
    for seq, tokens, snapshot in chunks:
        start, done = len(ids), len(seq.tokens)
        ids += tokens
        positions += range(done, done + len(tokens))
        kv_slots += seq.kv_slots(done, len(tokens))
        prefills.append(PrefillChunk(start, len(ids), done + len(tokens), torch.tensor(seq.blocks)))
        state_chunks.append(StateChunk((start, len(ids)), seq.slot, done == 0, snapshot))
    lens = [len(seq.tokens) + 1 for seq, _ in decodes]
    tables = torch.tensor([seq.blocks for seq, _ in decodes]) if decodes else None
    attention = AttentionMetadata(torch.tensor(kv_slots), len(decodes), tables, torch.tensor(lens), prefills,
                                  max(lens, default=0), len(set(lens)) <= 1)
    recurrent = RecurrentMetadata(torch.tensor([seq.slot for seq, _ in decodes], dtype=torch.long),
                                  list(decode_snapshots), state_chunks)
    metas = [recurrent if isinstance(spec, RecurrentStateSpec) else attention for spec in kv_cache_specs(model)]
    for seq, token in decodes:
        seq.tokens.append(token)
    for seq, tokens, _ in chunks:
        seq.tokens += tokens
    return model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), caches, metas))


@torch.no_grad()
def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    return reference(torch.tensor([tokens])).logits[0]


def states(caches: list, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(c.conv[slot].clone(), c.ssm[slot].clone()) for c in caches if isinstance(c, RecurrentState)]


def assert_states_close(ours: list, theirs: list) -> None:
    for (conv, ssm), (ref_conv, ref_ssm) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(conv, ref_conv, atol=1e-5, rtol=0)
        torch.testing.assert_close(ssm, ref_ssm, atol=1e-5, rtol=0)


def test_each_layer_reports_its_cache(model):
    """What the engine sizes the pools by: one spec per layer, in layer order."""
    specs = kv_cache_specs(model)
    recurrent = RecurrentStateSpec(conv_shape=(2 * 2 * 16 + 4 * 24, 3), ssm_shape=(4, 16, 24))
    assert specs == [recurrent] * 3 + [FullAttentionSpec()]
    assert recurrent.layer_bytes == 4 * (160 * 3 + 4 * 16 * 24)


def test_whole_prompt_prefill_matches_transformers(model, reference):
    ours = step(model, fresh_caches(model), chunks=[Chunk(Seq(2, list(range(6)), []), PROMPT)])
    theirs = reference_logits(reference, PROMPT)
    assert theirs.std(-1).mean() > 0.3  # logits far from uniform: a meaningful comparison
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def prefill_in_two_chunks(model, caches: list, seq: Seq) -> torch.Tensor:
    """PROMPT as 0..10 (the sequence's first chunk) and 10..24 (continuing from the state the first left)."""
    first = step(model, caches, chunks=[Chunk(seq, PROMPT[:10])])
    return torch.cat([first, step(model, caches, chunks=[Chunk(seq, PROMPT[10:])])])


def test_a_second_chunk_continues_the_state_of_the_first(model, reference):
    ours = prefill_in_two_chunks(model, fresh_caches(model), Seq(1, list(range(6, 12)), []))
    torch.testing.assert_close(ours, reference_logits(reference, PROMPT), atol=ATOL, rtol=0)


def test_decode_steps_after_a_chunked_prefill_match_transformers(model, reference):
    caches, seq = fresh_caches(model), Seq(4, [9, 3, 17, 5, 0, 12, 30, 21], [])
    logits = [prefill_in_two_chunks(model, caches, seq)[-1]]
    for _ in range(8):
        logits.append(step(model, caches, decodes=[(seq, int(logits[-1].argmax()))])[0])
    theirs = reference_logits(reference, seq.tokens)[len(PROMPT) - 1 :]
    torch.testing.assert_close(torch.stack(logits), theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cut", [12, 20])
def test_a_snapshot_partway_through_a_chunk_is_the_state_of_that_prefix(model, reference, cut):
    """The chunk 6..20 copies its state after cut - 6 of its tokens (20: all of them) into slot 5: the state a
    prefill of PROMPT[:cut] alone leaves, from which a sequence sharing that prefix goes on as the reference."""
    caches, seq = fresh_caches(model), Seq(0, list(range(6)), [])
    step(model, caches, chunks=[Chunk(seq, PROMPT[:6])])
    step(model, caches, chunks=[Chunk(seq, PROMPT[6:20], (cut - 6, 5))])
    prefix_caches, prefix = fresh_caches(model), Seq(3, list(range(6)), [])
    step(model, prefix_caches, chunks=[Chunk(prefix, PROMPT[:cut])])
    assert_states_close(states(caches, 5), states(prefix_caches, 3))

    for cache in caches:  # a prefix-cache hit: the prefix's K/V blocks shared, the checkpoint copied to its own slot
        if isinstance(cache, RecurrentState):
            cache.copy(5, 1)
    resumed = Seq(1, seq.blocks[: cut // BLOCK] + list(range(6, 12)), PROMPT[:cut])
    ours = step(model, caches, chunks=[Chunk(resumed, PROMPT[cut:])])
    torch.testing.assert_close(ours, reference_logits(reference, PROMPT)[cut:], atol=ATOL, rtol=0)


def test_a_decode_snapshot_is_the_state_after_the_step(model):
    caches, seq = fresh_caches(model), Seq(2, list(range(8)), [])
    step(model, caches, chunks=[Chunk(seq, PROMPT[:15])])
    step(model, caches, decodes=[(seq, PROMPT[15])], decode_snapshots=[(2, 4)])
    assert_states_close(states(caches, 4), states(caches, 2))


def test_decode_rows_beside_a_prefill_chunk_each_match_their_reference(model, reference):
    """Two running sequences (slots 3 and 0, out of order) decode while a third's first chunk is prefilled."""
    caches = fresh_caches(model)
    a, b, c = Seq(3, list(range(0, 8)), []), Seq(1, list(range(8, 16)), []), Seq(0, list(range(16, 24)), [])
    other = prompt(17, seed=12)
    step(model, caches, chunks=[Chunk(a, PROMPT[:13]), Chunk(c, other[:7])])
    ours = step(model, caches, decodes=[(a, PROMPT[13]), (c, other[7])], chunks=[Chunk(b, other[3:12])])
    torch.testing.assert_close(ours[0], reference_logits(reference, PROMPT[:14])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[1], reference_logits(reference, other[:8])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[2:], reference_logits(reference, other[3:12]), atol=ATOL, rtol=0)


def test_config_reads_the_linear_attention_fields(checkpoint):
    config = load_checkpoint(str(checkpoint)).config
    assert family_of(config.architecture) is QWEN3_5 and config.architecture == "qwen3_5_text"
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.qk_norm and config.rope_scaling is None and config.rope_theta == 10000.0
    f = config.extra
    assert (f.linear_num_key_heads, f.linear_num_value_heads, f.linear_key_head_dim, f.linear_value_head_dim,
            f.linear_conv_kernel_dim) == (2, 4, 16, 24, 4)
    assert f.rotary_dim(config.head_dim) == 8


def test_the_config_llmpipe_writes_reads_back(checkpoint, tmp_path):
    """What `llmpipe quantize` writes beside a quantized Qwen3.5."""
    config = load_checkpoint(str(checkpoint)).config
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    assert hf_model_config(tmp_path) == config


def multimodal_copy(checkpoint: Path, out: Path) -> Path:
    """The checkpoint as Qwen3_5ForConditionalGeneration saves it: the text config under text_config, the text
    model's tensors under model.language_model., beside vision and multi-token-prediction tensors."""
    config = json.loads((checkpoint / "config.json").read_text())
    nested = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False,
              "text_config": config, "vision_config": {"depth": 1}}
    tensors = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: tensor
               for name, tensor in load_file(checkpoint / "model.safetensors").items()}
    tensors |= {"model.visual.patch_embed.weight": torch.ones(2, 2), "mtp.fc.weight": torch.ones(2, 2)}
    out.mkdir()
    (out / "config.json").write_text(json.dumps(nested))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_multimodal_checkpoint_loads_as_its_text_model(checkpoint, tmp_path):
    text, multimodal = load_checkpoint(str(checkpoint)), load_checkpoint(str(multimodal_copy(checkpoint, tmp_path / "mm")))
    assert multimodal.config.architecture == "qwen3_5"
    assert {**vars(multimodal.config), "architecture": "qwen3_5_text"} == vars(text.config)
    for (name, tensor), (text_name, text_tensor) in zip(multimodal.iter_weights(), text.iter_weights(), strict=True):
        assert name == text_name and torch.equal(tensor, text_tensor)


@pytest.mark.parametrize(("options", "refusal"), [
    (dict(speculative_method="ngram"), "speculative decoding"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_engine_options_it_cannot_run_with_are_refused(options, refusal):
    with pytest.raises(UnsupportedModelError, match=refusal):
        QWEN3_5.check_engine_options(EngineConfig(**options))
