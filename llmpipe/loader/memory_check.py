"""Whether a model can fit before it loads: the weights' bytes on disk plus the KV pool, against the
memory the machine can still give (MemAvailable + SwapFree). Both sides are lower bounds of what a
load takes, so a model that fails this check could never load, and one that passes is never refused;
it fails in a second with one line rather than minutes into a load that ends in the OOM killer."""

from __future__ import annotations

from pathlib import Path

from llmpipe.errors import ModelLoadError

MEMINFO = Path("/proc/meminfo")
GiB = 2**30
DEFAULT_KV_POOL = GiB  # kv_cache_memory "auto" where the machine has room for it beside the weights
MIN_KV_POOL = 128 << 20  # and never less than this (a few thousand tokens of an 8B's cache)


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable + SwapFree in bytes; None where /proc/meminfo does not say (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        kib = [int(fields[name].split()[0]) for name in ("MemAvailable", "SwapFree")]
    except (OSError, KeyError, ValueError):
        return None
    return sum(kib) * 1024


def check_fits(model: str, weight_bytes: int, kv_pool_bytes: int, available: int | None) -> None:
    """ModelLoadError, in one line, when the weights and the KV pool alone are more than `available`."""
    needed = weight_bytes + kv_pool_bytes
    if available is None or needed <= available:
        return
    raise ModelLoadError(
        f"{model} needs at least {needed / GiB:.1f} GiB (weights {weight_bytes / GiB:.1f} GiB + KV pool "
        f"{kv_pool_bytes / GiB:.1f} GiB) and this machine has {available / GiB:.1f} GiB available: free memory, "
        "choose a smaller quantization, or lower --kv-cache-memory"
    )


def auto_kv_pool(weight_bytes: int, available: int | None) -> int:
    """kv_cache_memory "auto": DEFAULT_KV_POOL, or half of what the machine has left beside the weights where
    that is less (an 8B on a 16 GB laptop keeps room for the OS and the page cache), MIN_KV_POOL at least."""
    if available is None:
        return DEFAULT_KV_POOL
    return max(MIN_KV_POOL, min(DEFAULT_KV_POOL, (available - weight_bytes) // 2))
