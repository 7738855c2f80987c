"""The prefix cache's offload tiers through the engine: a prefix the pool evicted comes back from host memory or
disk instead of being recomputed, after a restart too, with the same tokens as computing it; a corrupt or torn
disk file is recomputed, never served; another model never reads a model's tier."""

import random

import pytest

from llmpipe import LLM, SamplingParams
from llmpipe.engine.core_messages import EngineCoreRequest
from llmpipe.kv_cache.disk_tier import SUFFIX, file_name

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama_gqa"))


def prompt(seed: int, length: int = 200) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(length)]}


@pytest.fixture(scope="module")
def reference(path):
    """Each prompt's greedy tokens, computed without any cache reuse."""
    llm = LLM(path, progress=False, enable_prefix_caching=False)
    return lambda p: llm.generate([p], GREEDY)[0].outputs[0].token_ids


def computed_into(folder, model: str, p: dict) -> None:
    """p computed by an engine with a disk tier in folder, which then stops (its blocks on disk)."""
    llm = LLM(model, progress=False, max_num_blocks=30, kv_offload_dir=str(folder))
    llm.generate([p], GREEDY)
    llm.close()


def evict(llm: LLM, count: int = 3) -> None:
    """Prompts of their own that take every block of a 30-block pool."""
    for seed in range(100, 100 + count):
        llm.generate([prompt(seed)], GREEDY)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_prefix_the_pool_evicted_comes_back_from_host_memory_unchanged(path, reference, kv_cache_dtype):
    llm = LLM(path, progress=False, max_num_blocks=30, kv_offload_memory="64MiB", kv_cache_dtype=kv_cache_dtype)
    p = prompt(1)
    first = llm.generate([p], GREEDY)[0]
    evict(llm)
    computed = llm.engine.stats().num_prefill_tokens
    again = llm.generate([p], GREEDY)[0]
    stats = llm.engine.stats()
    assert again.num_cached_tokens == 192  # every full block but the one holding the last prompt token
    assert stats.num_prefill_tokens - computed == 200 - 192
    assert stats.kv_offload.restored == 12 and stats.kv_offload.saved > 0 and stats.kv_offload.disk_reads == 0
    if kv_cache_dtype == "auto":
        assert again.outputs[0].token_ids == first.outputs[0].token_ids == reference(p)
    else:  # an int8 cache changes the numerics: the restored blocks must reproduce what computing gave
        assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_disk_tier_serves_a_prefix_after_a_restart(path, reference, tmp_path):
    p = prompt(2)
    computed_into(tmp_path, path, p)
    files = list(tmp_path.glob("*/*" + SUFFIX))
    assert len(files) >= 200 // BLOCK
    restarted = LLM(path, progress=False, max_num_blocks=30, kv_offload_dir=str(tmp_path))
    out = restarted.generate([p], GREEDY)[0]
    stats = restarted.engine.stats().kv_offload
    assert out.num_cached_tokens == 192 and stats.restored == 12 and stats.disk_reads == 12
    assert out.outputs[0].token_ids == reference(p)
    restarted.close()


def test_corrupt_and_torn_files_are_recomputed_never_served(path, reference, tmp_path):
    p = prompt(3)
    computed_into(tmp_path, path, p)
    # Damage the files of blocks 5 (a flipped byte) and 8 (cut short) of the prompt's 12 full blocks.
    restarted = LLM(path, progress=False, max_num_blocks=30, kv_offload_dir=str(tmp_path))
    core = restarted.engine.core
    seq = type("Seq", (), {"block_hashes": [], "all_token_ids": p["prompt_token_ids"], "cache_salt": None})()
    hashes = core.block_manager._hashes(seq, 12)
    disk = core.offload.disk
    five, eight = (disk.directory / file_name((0, hashes[i])) for i in (5, 8))
    data = bytearray(five.read_bytes())
    data[-3] ^= 0x10
    five.write_bytes(bytes(data))
    eight.write_bytes(eight.read_bytes()[:-100])
    out = restarted.generate([p], GREEDY)[0]
    assert out.num_cached_tokens == 5 * BLOCK  # served up to the first bad block, the rest recomputed
    stats = restarted.engine.stats().kv_offload
    assert stats.rejected == 2 and stats.saved == 2  # both dropped when read, then saved again once recomputed
    restarted.engine.core.offload.flush()
    assert five.exists() and eight.exists() and disk.read((0, hashes[5]), tuple(p["prompt_token_ids"][80:96]))
    assert out.outputs[0].token_ids == reference(p)
    restarted.close()


def test_another_model_never_reads_a_models_disk_tier(path, tiny_checkpoint, tmp_path):
    p = prompt(4)
    computed_into(tmp_path, path, p)
    other = LLM(str(tiny_checkpoint("qwen2")), progress=False, max_num_blocks=30, kv_offload_dir=str(tmp_path))
    assert other.generate([p], GREEDY)[0].num_cached_tokens == 0
    other.close()
    assert len(list(tmp_path.iterdir())) == 2  # a folder per model


def test_requests_under_different_cache_salts_share_no_blocks(path):
    llm = LLM(path, progress=False)
    p = prompt(5)
    llm.generate([p], GREEDY)
    core = llm.engine.core
    core.add_request(EngineCoreRequest("salted", p["prompt_token_ids"], GREEDY, cache_salt="tenant-b"))
    while core.has_unfinished_requests():
        outputs = core.step().outputs
    assert outputs[-1].num_cached_tokens == 0
