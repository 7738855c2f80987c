"""The disk tier of the prefix cache: one file per KV block, in a directory per model and cache geometry
(the fingerprint), so it survives a restart and is never read by another model.

A file is a magic line, a JSON header (the cache key, the block's tokens, each tensor's dtype and shape, the
payload's length and BLAKE2b checksum) and the payload. It is written by a background thread to a temporary
name and renamed when whole; a read checks everything the header says, and a file that fails — torn, truncated,
corrupted, another version — is deleted and its tokens recomputed, never served. The directory keeps at most
`max_bytes`; the least recently used files go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Hashable, Sequence

import torch

logger = logging.getLogger(__name__)

MAGIC = b"llmpipe-kv-block-1\n"
SUFFIX = ".kvb"
_HEADER_LEN = struct.Struct("<I")


def file_name(key: Hashable) -> str:
    """A key's file: a digest of its repr (ints and strings: the same in every process)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest() + SUFFIX


def checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode(key: Hashable, tokens: Sequence[int], tensors: Sequence[torch.Tensor]) -> bytes:
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    header = json.dumps({
        "key": repr(key), "tokens": list(tokens), "bytes": len(payload), "checksum": checksum(payload),
        "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors],
    }).encode()
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def decode(data: bytes, key: Hashable, tokens: Sequence[int]) -> tuple[torch.Tensor, ...] | None:
    """The tensors a file holds, or None if it is not a whole, uncorrupted block under key with these tokens."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LEN.size:
        return None
    start = len(MAGIC) + _HEADER_LEN.size
    (header_len,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start : start + header_len])
        specs = [(getattr(torch, name), tuple(shape)) for name, shape in header["tensors"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    payload = memoryview(data)[start + header_len :]
    if header.get("key") != repr(key) or header.get("tokens") != list(tokens) or len(payload) != header.get("bytes") \
            or checksum(payload) != header.get("checksum"):
        return None
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    tensors, offset = [], 0
    for dtype, shape in specs:
        count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset + count > len(flat):
            return None
        tensors.append(flat[offset : offset + count].view(dtype).view(shape))
        offset += count
    return tuple(tensors) if offset == len(flat) else None


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # file name → size, least recently used first; what earlier runs left is listed oldest first
        self.index: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        for path in sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns):
            self.index[path.name] = path.stat().st_size
            self.bytes += path.stat().st_size
        for stale in self.directory.glob("*.tmp"):  # a write a crash cut short
            stale.unlink(missing_ok=True)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    def __contains__(self, key: Hashable) -> bool:
        return file_name(key) in self.index

    def write(self, key: Hashable, tokens: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Queue a block for the writer thread (the tensors must not change afterwards)."""
        self._queue.put((key, tuple(tokens), tuple(tensors)))

    def read(self, key: Hashable, tokens: Sequence[int]) -> tuple[torch.Tensor, ...] | None:
        name = file_name(key)
        try:
            data = (self.directory / name).read_bytes()
        except OSError:
            self._forget(name)
            return None
        tensors = decode(data, key, tokens)
        if tensors is None:  # keys are 128-bit digests: a file naming other tokens is as bad as a torn one
            logger.warning("KV disk tier: %s failed verification; dropped, its tokens are recomputed", name)
            self._drop(name)
            return None
        with self._lock:
            if name in self.index:
                self.index.move_to_end(name)
        return tensors

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._store(*item)
            except Exception:  # a full disk or a vanished directory costs the tier its block, never the engine
                logger.exception("KV disk tier: writing a block failed")
            finally:
                self._queue.task_done()

    def _store(self, key: Hashable, tokens: tuple[int, ...], tensors: tuple[torch.Tensor, ...]) -> None:
        name = file_name(key)
        if name in self.index:
            return
        data = encode(key, tokens, tensors)
        if len(data) > self.max_bytes:
            return
        tmp = self.directory / f"{name}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.directory / name)
        with self._lock:
            self.index[name] = len(data)
            self.bytes += len(data)
            evict = []
            while self.bytes > self.max_bytes and self.index:
                old, size = self.index.popitem(last=False)
                self.bytes -= size
                evict.append(old)
        for old in evict:
            (self.directory / old).unlink(missing_ok=True)

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self.index.pop(name, None)
            if size is not None:
                self.bytes -= size

    def _drop(self, name: str) -> None:
        self._forget(name)
        (self.directory / name).unlink(missing_ok=True)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

