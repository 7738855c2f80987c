"""ServedAdapters: the engine core's LoRA adapters, loaded and unloaded between steps, and what each
adapter's requests seed their prefix-cache hashes with.

A block computed under an adapter holds K/V that differ from the base model's for the same tokens, so a
request's blocks are hashed from a salt naming the adapter's *contents* (a digest of its factors, taken once
at load): a base request never reuses them, a second request of the same adapter does, and an adapter
unloaded and loaded again under the same name with other weights never meets its old blocks (which may
outlive the process in the KV offload tier's disk files). A request's own cache_salt is kept beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Callable, Collection

from llmpipe.engine.core_messages import CommandResult, LoRACommand
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.lora.adapter import LoRAAdapter
from llmpipe.lora.manager import LoRAManager, read_adapter

logger = logging.getLogger(__name__)
SALT_MARK = "\x00lora"  # begins an adapter's salt; a client's cache_salt may not hold "\x00" (Admission)


class AdapterNotFoundError(InvalidRequestError):
    """No adapter of that name is loaded (the server answers 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no LoRA adapter named {name!r} is loaded", param="lora_name", code="not_found")


class ServedAdapters:
    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager  # None: the engine runs without LoRA (enable_lora off)
        # Every adapter loaded, read: more than the manager's slots (max_loras) may be; a slot is taken when a
        # request under the adapter starts (admit), from the least recently used adapter no running request uses.
        self.adapters: dict[str, LoRAAdapter] = {}
        self.digests: dict[str, str] = {}
        self.paths: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def listing(self) -> dict[str, str] | None:
        """name → path of every adapter loaded (None: LoRA is off)."""
        return dict(self.paths) if self.enabled else None

    def load(self, name: str, path: str) -> LoRAAdapter:
        return self.add(self.read(name, path), path)

    def read(self, name: str, path: str | None) -> LoRAAdapter:
        """The adapter file read and checked against the model, taking no slot: what may run off the step
        (the engine core reads a file a load command names on a thread of its own, CoreLoop)."""
        manager = self._manager()
        if not path:
            raise InvalidRequestError("loading a LoRA adapter needs its path", param="lora_path")
        self._check_new(name)
        return read_adapter(name, path, manager.targets)

    def add(self, adapter: LoRAAdapter, path: str) -> LoRAAdapter:
        """An adapter read for this model, served from now on (it takes a slot when a request under it starts)."""
        self._manager()
        self._check_new(adapter.name)
        self.adapters[adapter.name] = adapter
        self.digests[adapter.name], self.paths[adapter.name] = content_digest(adapter), str(path)
        logger.info("LoRA adapter %r loaded from %s (rank %d)", adapter.name, path, adapter.rank)
        return adapter

    def unload(self, name: str, requests_in_flight: int = 0) -> None:
        """Refused while requests in flight run under the adapter: they would lose it mid-sequence."""
        self.check(name)
        if requests_in_flight:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {requests_in_flight} request(s) in flight; "
                                      "unload it once they finish", param="lora_name")
        if name in self._manager().slot_of:
            self._manager().unload(name)
        del self.adapters[name], self.digests[name], self.paths[name]

    def admit(self, name: str | None, in_use: Collection[str]) -> bool:
        """Whether a request under `name` may start now: the base model always; an adapter once it holds a slot
        (taken now if one is free or held by an adapter outside `in_use`, the running requests' adapters)."""
        return name is None or self._manager().make_resident(self.adapters[name], in_use)

    def _check_new(self, name: str) -> None:
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")

    def check(self, name: str | None) -> None:
        """InvalidRequestError unless `name` is None (the base model) or a loaded adapter."""
        if name is None:
            return
        if not self.enabled:
            raise InvalidRequestError(f"the request names LoRA adapter {name!r}, but this engine runs without LoRA "
                                      "(enable_lora)", param="lora_name")
        if name not in self.digests:
            raise AdapterNotFoundError(name)

    def salt(self, lora_name: str | None, cache_salt: str | None) -> str | None:
        """The prefix-cache salt of a request under `lora_name` (None: the base model) with its own cache_salt."""
        if lora_name is None:
            return cache_salt
        return f"{SALT_MARK}:{self.digests[lora_name]}:{cache_salt or ''}"

    def apply(self, command: LoRACommand, requests_in_flight: int = 0,
              read: Callable[[], LoRAAdapter] | None = None) -> CommandResult:
        """Run a load or unload command; its outcome (an error as a 4xx status, never raised). read: what a
        load's file gave, read already (`read`, off the step): the result, or raising what reading raised."""
        try:
            if command.action == "load":
                self.add(read() if read is not None else self.read(command.name, command.path), command.path)
            elif command.action == "unload":
                self.unload(command.name, requests_in_flight)
            else:
                raise InvalidRequestError(f"unknown LoRA command {command.action!r}")
        except AdapterNotFoundError as err:
            return CommandResult(command.command_id, 404, str(err), self.listing() or {})
        except LLMPipeError as err:  # a bad or refused adapter, no free slot, a duplicate name
            return CommandResult(command.command_id, 400, str(err), self.listing() or {})
        except Exception as err:  # noqa: BLE001 - a file that fails to parse some other way is still the caller's
            logger.exception("loading LoRA adapter %r failed", command.name)
            return CommandResult(command.command_id, 400, f"the LoRA adapter could not be loaded: {err}",
                                 self.listing() or {})
        return CommandResult(command.command_id, 200, None, self.listing() or {})

    def _manager(self) -> LoRAManager:
        if self.manager is None:
            raise InvalidRequestError("this engine runs without LoRA: start it with enable_lora (--enable-lora)",
                                      param="lora_name")
        return self.manager


def content_digest(adapter: LoRAAdapter) -> str:
    """A digest of what the adapter computes: every module's factors, by module name (not its name or path)."""
    digest = hashlib.blake2b(digest_size=16)
    for module in sorted(adapter.modules):
        factors = adapter.modules[module]
        digest.update(json.dumps([module, list(factors.a.shape), list(factors.b.shape)]).encode())
        digest.update(factors.a.float().contiguous().numpy().tobytes())
        digest.update(factors.b.float().contiguous().numpy().tobytes())
    return digest.hexdigest()
