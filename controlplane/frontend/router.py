"""``CoreRouter``: a front end's streams to the server's data-parallel engine cores
(``--data-parallel-size M``: one ``CoreClient`` per core), standing where the ``Engine`` stands
for the request path, as one ``CoreClient`` does for one core.

- Placement (``headrace.controlplane.frontend.placement``): each request goes to the core chosen from the cores'
  published load and prefix caches, matched with the prompt's chained block hashes computed
  here (the prompt's token ids go to the chosen core only); the chosen core's view expects the
  prompt's blocks at once, so a burst sharing a new prefix follows its first request.
- Which core served a request: ``headrace:placements_total{core, reason}``, the request span's
  ``headrace.core`` / ``headrace.placement`` attributes, and the core's own span and log lines.
- A core lost (its stream ended) or whose data plane is lost (it reports unhealthy), or that
  fails a request UNAVAILABLE (shutting down, draining alone, not ready): its requests resume
  on another ready core with the tokens their samples had generated (``Submit.resumed``:
  nothing the client received is sent again, nothing is lost; each request tries every core
  once at most), and new requests avoid it until it is back. With no other core ready, a lost
  core's requests wait for it to come back (``headrace.controlplane.frontend.resume``) and an unhealthy
  core keeps its own (it resumes them when its data plane is back).
- Queues: each core bounds its own queue (``--max-queued``) and refuses what would pass it
  (``headrace.controlplane.core.service``). Placement leaves out a core whose queue, as it last pushed
  it, has no room for the request while another's has; a core that refuses it
  RESOURCE_EXHAUSTED all the same hands it to another core with room.
- What the request path reads: ready / healthy while any core is; draining when every healthy
  core drains; the model's limits are the tightest of the loaded cores'.
"""

from __future__ import annotations

import itertools
import types

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from headrace.common.logs import get_logger
from headrace.common.metrics import PREFIX
from headrace.controlplane.requests import limits
from headrace.controlplane.kv.cache_summary import prompt_hashes
from headrace.controlplane.frontend.client import CoreClient
from headrace.controlplane.frontend.placement import Placement
from headrace.controlplane.requests.request import Failure, Request

log = get_logger("headrace.frontend")
NO_CORE = "no engine core is ready (restarting?); retry"


class _QueueView:
    """The shortest queue the ready cores last pushed (the request path's early queue check: a
    request is refused only when no core would take it; each core decides again on its own
    queue when the request reaches it)."""

    def __init__(self, router: "CoreRouter"):
        self.router = router

    @property
    def num_queued(self) -> int:
        queues = [c.scheduler.num_queued for c in self.router.clients if c.ready]
        return min(queues, default=0)


def _queue_full(client: CoreClient, weight: int) -> bool:
    """Whether ``client``'s core would refuse ``weight`` more sequences, as it last said."""
    return limits.queue_refusal(client.max_queued, client.scheduler.num_queued, weight) is not None


class _Unready:
    """A core left out of a placement (the one just lost)."""

    ready, load = False, 0

    @staticmethod
    def match(hashes) -> int:
        return 0


class CoreRouter:
    def __init__(self, addresses: list[str], index: int, metrics, on_change=None, *,
                 credentials: grpc.ChannelCredentials | None = None, secret: str | None = None,
                 placement: Placement | None = None, resume_deadline_s: float = 60.0):
        self.clients = [CoreClient(address, index, metrics, on_change=self._changed,
                                   credentials=credentials, secret=secret, placement=True,
                                   resume_deadline_s=resume_deadline_s)
                        for address in addresses]
        for client in self.clients:
            client.on_lost, client.on_failed = self._resume, self._failed
        self.index, self.placement, self.on_change = index, placement or Placement(), on_change
        self.telemetry = types.SimpleNamespace(metrics=metrics)
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count(1)
        self._core_of: dict[str, int] = {}
        self._healthy = [False] * len(self.clients)
        self._queue = _QueueView(self)
        self.placements = None if metrics is None else Counter(
            PREFIX + "placements", "Requests placed on each data-parallel engine core, by reason: "
            "prefix (it caches the prompt's prefix), load (the least loaded), balance (the least "
            "loaded, the prefix holder being much busier), round_robin, resume (moved from a lost "
            "core).", ["core", "reason"], registry=metrics.registry)

    # -- what the request path reads ------------------------------------------------------------
    @property
    def primary(self) -> CoreClient:
        """A ready core (else a healthy one, else the first): the model's state and config."""
        for test in (lambda c: c.ready, lambda c: c.healthy):
            for client in self.clients:
                if test(client):
                    return client
        return self.clients[0]

    @property
    def healthy(self) -> bool:
        return any(c.healthy for c in self.clients)

    @property
    def draining(self) -> bool:
        healthy = [c for c in self.clients if c.healthy]
        return bool(healthy) and all(c.draining for c in healthy)

    @property
    def ready(self) -> bool:
        return any(c.ready for c in self.clients)

    @property
    def state(self):
        return self.primary.state

    def lora_adapters(self) -> list:
        return self.primary.lora_adapters()

    @property
    def info(self):
        return self.primary.info

    @property
    def config(self):
        return self.primary.config

    @property
    def max_queued(self) -> int:
        return self.primary.max_queued

    @property
    def max_model_len(self) -> int:
        lengths = [c.max_model_len for c in self.clients if c.scheduler is not None]
        return min(lengths, default=self.primary.max_model_len)

    @property
    def scheduler(self):
        return self._queue if any(c.scheduler is not None for c in self.clients) else None

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._place(request)

    def abort(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        core = self._core_of.pop(request.request_id, None)
        if core is not None:
            self.clients[core].abort(request)

    def _hashes(self, request: Request) -> list[int]:
        if self.placement.policy != "prefix":
            return []
        block_size = self.primary.core_load.block_size or (self.info.block_size if self.info else 0)
        root = 0
        if request.lora_name:   # its adapter's chain (cores agree: it is the files' hash)
            adapter = next((a for a in self.lora_adapters() if a.name == request.lora_name), None)
            if adapter is None or not adapter.cache_root:
                return []
            root = adapter.cache_root
        return prompt_hashes(request.sequences[0].prompt_token_ids, block_size, root) if block_size else []

    def _lora_warm(self, request: Request, cores: list) -> list:
        """``cores`` with only those that hold the request's LoRA adapter in a slot (else in
        their host caches) left ready, unless those are much busier than the least loaded
        core: loading an adapter costs a read from disk or a copy, a busy core more."""
        name = request.lora_name
        ready = [c for c in cores if c.ready]
        if not name or not ready:
            return cores
        for where in ("lora_in_slots", "lora_cached"):
            warm = [c for c in ready if name in getattr(c.core_load, where)]
            if warm:
                if self.placement.much_busier(min(c.load for c in warm), min(c.load for c in ready)):
                    return cores
                return [c if c in warm else _Unready() for c in cores]
        return cores

    def _place(self, request: Request, lost: CoreClient | None = None) -> None:
        """Sends ``request`` to the core placement chooses (``lost``: it resumes, not there)."""
        hashes = self._hashes(request)
        cores = [_Unready() if c is lost else c for c in self.clients]
        weight = sum(not s.finished for s in request.sequences) or 1
        full = [i for i, c in enumerate(cores) if c.ready and _queue_full(c, weight)]
        if full and len(full) < sum(c.ready for c in cores):   # a core with room takes it
            cores = [_Unready() if i in full else c for i, c in enumerate(cores)]
        cores = self._lora_warm(request, cores)
        choice = self.placement.choose(cores, hashes)
        if choice is None and lost is not None and not lost._stopping:
            lost.parked.keep([request])   # no other core: it waits for its own to come back
            return
        if choice is None:
            self.requests.pop(request.request_id, None)
            self._core_of.pop(request.request_id, None)
            request.fail(Failure(grpc.StatusCode.UNAVAILABLE, NO_CORE))
            return
        client = self.clients[choice.index]
        if hashes:
            client.view.expect(hashes)
        self._core_of[request.request_id] = choice.index
        client.submit(request, resume=lost is not None)
        reason = "resume" if lost is not None else choice.reason
        if self.placements is not None:
            self.placements.labels(str(choice.index), reason).inc()
        if lost is None:   # (a resumption runs outside the request's span)
            span = trace.get_current_span()
            span.set_attribute("headrace.core", choice.index)
            span.set_attribute("headrace.placement", reason)
            span.set_attribute("headrace.prefix_blocks_matched", choice.matched)

    def _failed(self, client: CoreClient, request: Request, failure: Failure) -> bool:
        """Whether a request ``client``'s core could not serve goes on elsewhere."""
        tries = getattr(request, "core_tries", 1)
        others = [c for c in self.clients if c is not client and c.ready]
        if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:   # its queue filled meanwhile
            weight = sum(not s.finished for s in request.sequences) or 1
            others = [c for c in others if not _queue_full(c, weight)]
        elif failure.code != grpc.StatusCode.UNAVAILABLE:
            return False
        if request.request_id not in self.requests or tries >= len(self.clients) or not others:
            return False
        request.core_tries = tries + 1
        self._resume(client, [request])
        return True

    def _resume(self, lost: CoreClient, requests: list[Request]) -> None:
        """``lost``'s requests go on elsewhere, from the tokens they had."""
        moved = [r for r in requests if r.request_id in self.requests and not r.finished]
        for request in moved:
            self._place(request, lost=lost)
        if moved:
            log.warning("engine core lost: its requests resume on other cores", address=lost.address,
                        requests=len(moved))

    def _changed(self) -> None:
        """A core's state changed; one whose data plane was lost hands its requests over while
        another core is ready."""
        for i, client in enumerate(self.clients):
            was, self._healthy[i] = self._healthy[i], client.healthy
            if was and client.connected and not client.healthy and client.requests and \
                    any(c.ready for c in self.clients if c is not client):
                self._resume(client, client.take_requests())
        if self.on_change is not None:
            self.on_change()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        for client in self.clients:
            client.start()

    async def stop(self) -> None:
        for client in self.clients:
            await client.stop()
