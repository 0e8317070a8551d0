"""The LoRA adapters an engine serves (multi-LoRA serving, docs/lora.md): their names and paths
(``--lora-modules``, Admin / HTTP ``load_lora_adapter``), which data-plane host caches and
device slots hold them (``headrace.controlplane.lora.slots``), and the rule the scheduler admits by: a
sequence runs only once its adapter is in a slot.

An adapter is read into the workers' host caches (``LoadAdapter``, off the step stream) when
it is registered at run time (its errors are the caller's: a bad adapter is refused at once),
at start for the first ``--max-cpu-loras`` of ``--lora-modules``, else when a request first
needs it; meanwhile its requests wait (others run). A read the
workers refuse fails the requests waiting for it (INVALID_ARGUMENT with the reason), and the
adapter stays listed with its error. Its fingerprint (the files' hash, from the workers) roots
the hash chain of its prompt blocks, so two adapters never share KV, nor an adapter and the
base model, in either KV tier (``BlockManager.match_prefix``'s ``root``).

Unloading stops new requests at once (NOT_FOUND), waits for the requests still using the
adapter (up to the caller's ``wait_s``; if some remain it is served again and the caller gets
FAILED_PRECONDITION), then forgets it everywhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from headrace.common import stage_times
from headrace.controlplane.lora.slots import Adapter, Slots
from headrace.controlplane.requests.request import Failure
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.lora")
NAME_CHARS = 200


class LoraError(Exception):
    """A refused LoRA operation: ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def parse_modules(specs) -> list[tuple[str, str]]:
    """``--lora-modules`` entries (``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``)
    as (name, path); ValueError naming a malformed one."""
    import json

    out, seen = [], set()
    for spec in specs or ():
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                obj = json.loads(spec)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {spec!r}: give name=path or "
                                 '{"name": NAME, "path": PATH}') from None
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {spec!r}: give name=path")
        name, path = str(name).strip(), str(path).strip()
        if not name or not path or len(name) > NAME_CHARS:
            raise ValueError(f"--lora-modules {spec!r}: a name (at most {NAME_CHARS} characters) "
                             "and a path are needed")
        if name in seen:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        seen.add(name)
        out.append((name, path))
    return out


class LoraAdapters:
    def __init__(self, modules: list[tuple[str, str]] = (), engine=None):
        self.modules = list(modules)   # --lora-modules, registered when the workers are known
        self.engine = engine            # headrace.controlplane.engine.loop.Engine: its requests
        self.by_name: dict[str, Adapter] = {}
        self.slots: Slots | None = None
        self.max_loras = self.max_cpu_loras = self.max_rank = 0
        self.workers = None
        self.wake = lambda: None        # the engine's: a read landed
        self.on_change = lambda: None   # an adapter's state changed (the front ends learn it)
        self._ids = itertools.count(1)
        self._next_cache_id = 1         # every read's host-cache key (``Adapter.cache_id``)
        self._synced: asyncio.Future | None = None   # the workers dropped what was read before a reset
        self._generation = 0            # reads started before a reset are not trusted after it
        self.num_reads = 0
        self.read_seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    def configure(self, infos, workers, wake) -> None:
        """The workers' LoRA capacity (``WorkerInfo``); forgets what their caches held."""
        self.max_loras = min(i.max_loras for i in infos)
        self.max_cpu_loras = min(i.max_cpu_loras for i in infos) if self.max_loras else 0
        self.max_rank = min(i.max_lora_rank for i in infos) if self.max_loras else 0
        self.workers, self.wake = workers, wake
        self.slots = Slots(self.max_loras, max(self.max_cpu_loras, self.max_loras)) \
            if self.enabled else None
        self.reset()
        for name, path in self.modules:
            if name not in self.by_name:
                self.by_name[name] = Adapter(name, path, next(self._ids))
        self.modules = []
        for adapter in self.by_name.values():
            adapter.error = "" if self.enabled else "the data planes were started without --enable-lora"
        if self.by_name and not self.enabled:
            log.error("LoRA adapters %s are registered but the data planes have no LoRA slots "
                      "(start them with --enable-lora)", sorted(self.by_name))
        elif self.enabled:   # read the first ones now, one after the other: refused ones are
            # said at start, and the first requests wait less
            first = list(self.by_name.values())[:self.slots.capacity]
            asyncio.ensure_future(self._read_each(first, self._generation))

    def reset(self) -> None:
        """The workers lost their state (or may have): every adapter is read again when next
        needed, after the workers dropped every copy read before (``below_id``)."""
        self._generation += 1
        if self.slots is not None:
            self.slots.reset()
        for adapter in self.by_name.values():
            adapter.loading = None
            adapter.slot, adapter.cached = None, False
        if self.enabled and self.workers is not None and self._next_cache_id > 1:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return
            self._synced = asyncio.ensure_future(self.workers.drop_adapters([], self._next_cache_id))
            self._synced.add_done_callback(lambda f: f.cancelled() or f.exception())   # (seen)

    # -- requests -----------------------------------------------------------------------------
    def get(self, name: str) -> Adapter | None:
        adapter = self.by_name.get(name)
        return None if adapter is None or adapter.unloading else adapter

    def refusal(self, name: str) -> tuple[grpc.StatusCode, str] | None:
        """Why a request for the adapter ``name`` cannot be served (None: it can)."""
        adapter = self.get(name)
        if adapter is None:
            return grpc.StatusCode.NOT_FOUND, f"the model {name!r} does not exist (no such LoRA adapter)"
        if adapter.error:
            return grpc.StatusCode.INVALID_ARGUMENT, f"LoRA adapter {name!r} cannot be served: {adapter.error}"
        return None

    def attach(self, request) -> bool:
        """Gives every sample of ``request`` its adapter (``request.lora_name``); a request
        that cannot be served fails at once (False)."""
        refusal = self.refusal(request.lora_name)
        if refusal is not None:
            request.fail(Failure(*refusal))
            return False
        adapter = self.by_name[request.lora_name]
        for seq in request.sequences:
            seq.lora = adapter
        return True

    def users(self, adapter: Adapter) -> int:
        """Unfinished sequences of ``adapter`` (an unload waits for them)."""
        return sum(not s.finished and s.lora is adapter
                   for r in self.engine.requests.values() for s in r.sequences)

    def fail(self, adapter: Adapter) -> None:
        """The workers refused ``adapter``: the requests waiting for it fail with the reason."""
        if self.engine is None:
            return
        for request in [r for r in self.engine.requests.values()
                        if any(s.lora is adapter for s in r.sequences)]:
            self.engine.abort(request)
            request.fail(Failure(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"LoRA adapter {adapter.name!r} cannot be served: {adapter.error}"))

    def listed(self) -> list:
        """The adapters as the public API lists them (``headrace.v1.LoraAdapter``)."""
        return [pb.LoraAdapter(name=a.name, path=a.path, rank=a.rank, cache_root=a.root, error=a.error)
                for a in self.adapters()]

    def admissible(self, adapter: Adapter, running) -> bool:
        """Whether a sequence of ``adapter`` may be admitted now: its adapter is in a slot, or
        takes one (the load goes out with the step). A read into the host caches is started
        when it is needed and not there."""
        if self.slots.acquire(adapter, running):
            return True
        if not adapter.cached and adapter.loading is None and not adapter.error and \
                sum(a.loading is not None for a in self.by_name.values()) < self.slots.capacity:
            self.start_read(adapter)
        return False

    async def _read_each(self, adapters: list[Adapter], generation: int) -> None:
        for adapter in adapters:
            if generation != self._generation or self.by_name.get(adapter.name) is not adapter:
                return
            if adapter.cached or adapter.error:
                continue
            try:
                await (adapter.loading or self.start_read(adapter))
            except Exception:  # noqa: BLE001 - logged by the read, said to its requests
                pass

    def start_read(self, adapter: Adapter) -> asyncio.Task:
        adapter.loading = asyncio.ensure_future(self._read(adapter, self._generation))
        return adapter.loading

    async def _read(self, adapter: Adapter, generation: int) -> None:
        if self._synced is not None:   # (a reset's drop first: it would take this read too)
            try:
                await self._synced
            except Exception as exc:  # noqa: BLE001 - the workers are gone: the read fails too
                log.warning("dropping the LoRA host caches after a reset failed: %s", exc)
            self._synced = None
        others = sum(a.loading is not None and a is not adapter for a in self.by_name.values())
        self.slots.make_room(adapter, others)
        adapter.cache_id, self._next_cache_id = self._next_cache_id, self._next_cache_id + 1
        start = time.monotonic()
        if stage_times.STAGES is not None:   # (benchmarks: bench.lora_bench's cold requests)
            stage_times.STAGES.stamp(f"lora:{adapter.name}", "read_start", at=start)
        try:
            answer = await self.workers.load_adapter(adapter.cache_id, adapter.path)
        except Exception as exc:  # noqa: BLE001 - the workers' refusal, said to its requests
            if generation == self._generation:
                adapter.loading = None
                adapter.error = _reason(exc)
                log.error("LoRA adapter %s (%s) cannot be served: %s", adapter.name, adapter.path,
                          adapter.error)
                self.fail(adapter)
                self.on_change()
            raise
        if generation != self._generation:   # (the reset's drop covers this copy)
            return
        if self.by_name.get(adapter.name) is not adapter:   # unloaded meanwhile: no step loads it
            await self.workers.drop_adapters([adapter.cache_id])
            return
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(f"lora:{adapter.name}", "read_done")
        adapter.loading, adapter.error = None, ""
        adapter.rank, adapter.root = answer.rank, answer.fingerprint or 1
        self.slots.cached(adapter)
        self.num_reads += 1
        self.read_seconds += time.monotonic() - start
        log.info("LoRA adapter %s read into the host caches (rank %d, %.3fs)", adapter.name,
                 answer.rank, time.monotonic() - start)
        self.wake()
        self.on_change()

    # -- Admin and HTTP ---------------------------------------------------------------------------
    async def register(self, name: str, path: str) -> Adapter:
        """Serves ``path`` as ``name`` once every worker has read it (LoraError otherwise)."""
        if not self.enabled:
            raise LoraError(grpc.StatusCode.FAILED_PRECONDITION,
                            "LoRA is off: start the server with --enable-lora")
        if not name or not path or len(name) > NAME_CHARS:
            raise LoraError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"lora_name (at most {NAME_CHARS} characters) and lora_path are required")
        old = self.by_name.get(name)
        if old is not None:
            raise LoraError(grpc.StatusCode.ALREADY_EXISTS,
                            f"the LoRA adapter {name!r} has already been loaded (from {old.path}); "
                            "unload it first")
        adapter = self.by_name[name] = Adapter(name, path, next(self._ids))
        try:
            await self.start_read(adapter)
        except Exception as exc:  # noqa: BLE001 - refused: not served
            self.by_name.pop(name, None)
            missing = isinstance(exc, FileNotFoundError) or \
                getattr(exc, "code", None) == grpc.StatusCode.NOT_FOUND
            raise LoraError(grpc.StatusCode.NOT_FOUND if missing else grpc.StatusCode.INVALID_ARGUMENT,
                            f"cannot load LoRA adapter {name!r}: {adapter.error}") from None
        log.info("LoRA adapter %s loaded from %s", name, path)
        return adapter

    async def unregister(self, name: str, wait_s: float) -> None:
        """Stops serving ``name`` once no sequence uses it (waiting up to ``wait_s``)."""
        adapter = self.by_name.get(name)
        if adapter is None or adapter.unloading:
            raise LoraError(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
        adapter.unloading = True
        deadline = time.monotonic() + max(0.0, wait_s)
        while self.users(adapter) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = self.users(adapter)
        if left:
            adapter.unloading = False
            raise LoraError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the LoRA adapter {name!r} is in use by {left} sequences; retry when "
                            f"they finish (or give a longer wait_s)")
        del self.by_name[name]
        if self.slots is not None:   # its host copy is dropped by the next step
            self.slots.forget(adapter)
            self.wake()
        log.info("LoRA adapter %s unloaded", name)

    def adapters(self) -> list[Adapter]:
        return [a for a in self.by_name.values() if not a.unloading]


def _reason(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    return details() if callable(details) else str(exc)
