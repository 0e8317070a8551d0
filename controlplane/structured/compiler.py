"""Compiles structured-output constraints off the event loops, once per distinct text.

Compiling a grammar can take from microseconds (a choice list) to seconds (a very large JSON
Schema). It runs in a small pool of threads (both engines release the GIL while they build a
grammar), so the engine loop keeps stepping and streaming while it runs. Results are cached
by a hash of (backend, kind, text, tokenizer): a request with a grammar compiled before gets
it at once, concurrent requests with the same text share one compilation, and a text that
failed fails the same way without compiling again. ``configure`` loads the backend (the
tokenizer's vocabulary as the grammar engine needs it) for the model served, at start and on
reload: llguidance holds the GIL while it reads a vocabulary (~1-2 s for 150k tokens), so
that happens before the engine serves, never beside running streams."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

from headrace.controlplane.structured import backends
from headrace.controlplane.structured.spec import Constraint, ConstraintError

log = logging.getLogger("headrace.structured")
COMPILE_THREADS = 2
CACHE_SIZE = 256   # compiled grammars kept (least recently used dropped first)


class GrammarCompiler:
    def __init__(self, backend: str = "auto", threads: int = COMPILE_THREADS,
                 cache_size: int = CACHE_SIZE):
        self.requested = backend
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="headrace-grammar")
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._backend: backends.Backend | None = None
        self._model: tuple[str, int, tuple[int, ...]] | None = None
        self.num_compiled = 0   # compilations run (cache misses)

    def configure(self, model_dir: str, vocab_size: int, eos_token_ids) -> None:
        """The model whose tokenizer grammars are compiled for (at start and on reload)."""
        model = (str(model_dir), int(vocab_size), tuple(eos_token_ids))
        if model != self._model:
            with self._lock:
                self._model, self._backend = model, None
            self._cache.clear()
            self._preload()

    def _preload(self) -> None:
        """Loads the backend now (a missing engine under ``auto`` only refuses constrained
        requests later; a failure is logged and retried by the first compilation)."""
        try:
            name = backends.resolve(self.requested)
        except backends.BackendUnavailable as exc:
            log.info("structured outputs unavailable: %s", exc)
            return
        start = time.perf_counter()
        try:
            backend = self.backend
        except Exception as exc:  # noqa: BLE001 - reported to the requests that need it
            log.warning("structured outputs: loading %s for %s failed: %s", name, self._model[0], exc)
            return
        log.info("structured outputs: %s ready for a vocabulary of %d in %.2fs", name,
                 backend.vocab_size, time.perf_counter() - start)

    @property
    def backend(self) -> backends.Backend:
        """The loaded backend (loads it on first use: call from the pool)."""
        with self._lock:
            if self._backend is None:
                if self._model is None:
                    raise ConstraintError("structured: the model is not loaded yet")
                name = backends.resolve(self.requested)
                self._backend = backends.load(name, *self._model[:2], list(self._model[2]))
            return self._backend

    def compile(self, constraint: Constraint) -> concurrent.futures.Future:
        """A future of the constraint's compiled grammar (``backends.Compiled``), done at once
        when cached; its exception is a ``ConstraintError`` or ``BackendUnavailable``."""
        try:
            name = backends.resolve(self.requested)
            if constraint.backend and constraint.backend != name:
                raise ConstraintError(
                    f"structured: backend {constraint.backend!r} is not available: this server "
                    f"compiles grammars with {name!r} (--structured-outputs-backend)")
        except (ConstraintError, backends.BackendUnavailable) as exc:
            failed = concurrent.futures.Future()
            failed.set_exception(exc)
            return failed
        model = self._model
        key = constraint.key(name, repr(model))
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, constraint)
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: Constraint) -> backends.Compiled:
        self.num_compiled += 1
        return self.backend.compile(constraint)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
