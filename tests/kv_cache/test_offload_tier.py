"""The prefix cache's tiers below the pool: host memory (least recently used out first) and disk files that are
verified on every read — a torn, truncated, corrupted or foreign file is dropped, never served."""

import torch

from llmpipe.kv_cache.block_pool import block_hash
from llmpipe.kv_cache.disk_tier import SUFFIX, DiskTier, decode, encode, file_name
from llmpipe.kv_cache.offload_tier import OffloadTier

KEY, TOKENS = (0, 12345678901234567890), (5, 6, 7, 8)


def block(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, 4, 3, 8, generator=g).to(torch.bfloat16),
            torch.randint(-128, 127, (2, 2, 4, 3, 8), dtype=torch.int8, generator=g),
            torch.rand(2, 2, 4, 3, 1, generator=g))


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_a_block_round_trips_through_its_file_encoding_bit_for_bit():
    tensors = block()
    assert_same(decode(encode(KEY, TOKENS, tensors), KEY, TOKENS), tensors)


def test_a_file_that_is_truncated_corrupted_or_names_other_tokens_decodes_to_nothing():
    data = encode(KEY, TOKENS, block())
    flipped = bytearray(data)
    flipped[-5] ^= 0x01
    assert decode(data[:-1], KEY, TOKENS) is None
    assert decode(data[: len(data) // 2], KEY, TOKENS) is None
    assert decode(bytes(flipped), KEY, TOKENS) is None
    assert decode(data, KEY, (5, 6, 7, 9)) is None
    assert decode(data, (1, KEY[1]), TOKENS) is None
    assert decode(b"not a block", KEY, TOKENS) is None


def test_block_hashes_are_stable_digests_seeded_by_the_cache_salt():
    first = block_hash(None, [1, 2, 3])
    assert first == block_hash(None, [1, 2, 3]) and first.bit_length() <= 128
    assert block_hash(None, [1, 2, 3], "adapter-a") not in (first, block_hash(None, [1, 2, 3], "adapter-b"))
    assert block_hash(first, [4]) != block_hash(None, [4])
    # a fixed value: the disk tier's keys must not change between processes (change it only with
    # kv_pool.TIER_FORMAT, which moves every model's disk tier to a new folder)
    assert block_hash(None, (1, 2, 3)) == 0x9967fa1e410801c51c545c27cff91afa


def test_disk_tier_serves_what_it_wrote_after_a_restart(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    disk.write(KEY, TOKENS, block())
    disk.flush()
    disk.close()
    again = DiskTier(tmp_path, max_bytes=1 << 20)
    assert KEY in again
    assert_same(again.read(KEY, TOKENS), block())


def test_disk_tier_drops_a_corrupt_file_and_cleans_up_torn_writes(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    disk.write(KEY, TOKENS, block())
    disk.flush()
    path = tmp_path / file_name(KEY)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    (tmp_path / "torn.123.tmp").write_bytes(b"half a block")
    disk.close()
    again = DiskTier(tmp_path, max_bytes=1 << 20)
    assert not (tmp_path / "torn.123.tmp").exists()
    assert again.read(KEY, TOKENS) is None
    assert KEY not in again and not path.exists()


def test_disk_tier_keeps_its_budget_dropping_the_least_recently_used(tmp_path):
    size = len(encode((0, 0), TOKENS, block()))
    disk = DiskTier(tmp_path, max_bytes=3 * size)
    for i in range(3):
        disk.write((0, i), TOKENS, block(i))
    disk.flush()
    assert disk.read((0, 0), TOKENS) is not None  # used: (0, 1) is now the oldest
    disk.write((0, 3), TOKENS, block(3))
    disk.flush()
    assert [(0, i) in disk for i in range(4)] == [True, False, True, True]
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 3 and disk.bytes <= disk.max_bytes


def test_memory_tier_keeps_its_budget_and_finds_from_disk_below(tmp_path):
    nbytes = sum(t.numel() * t.element_size() for t in block())
    tier = OffloadTier(2 * nbytes, DiskTier(tmp_path, max_bytes=1 << 20))
    for i in range(3):
        tier.put((0, i), TOKENS, block(i))
    tier.flush()
    assert list(tier.entries) == [(0, 1), (0, 2)] and tier.bytes == 2 * nbytes
    assert tier.find((0, 1), (1, 2, 3, 4)) is None  # other tokens under the key: not served
    assert_same(tier.find((0, 0), TOKENS).tensors, block(0))  # read back from disk
    assert tier.stats.disk_reads == 1 and tier.stats.saved == 3
    assert_same(tier.find((0, 2), TOKENS).tensors, block(2))
    assert tier.stats.disk_reads == 1
    tier.close()
