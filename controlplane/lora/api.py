"""What the public APIs say about LoRA adapters: which adapter a request's ``model`` names (the
base model's names, an adapter's, or NOT_FOUND as vLLM answers), the model cards of
``/v1/models`` (the base model and every adapter, with ``parent``), and the runtime load and
unload of adapters behind Admin and vLLM's ``/v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` (``LoraAdmin``: in the engine's process it acts on the engine, in
an API front end it calls the engine cores' Admin service), and the adapters a front end loads
again into a restarted core (``restorer``: the lost core's runtime loads, so the requests it
resumes find them).

The engine (``headrace.controlplane.engine.loop.Engine``) and a front end's core client both answer
``lora_adapters()`` with ``headrace.v1.LoraAdapter`` messages (the core pushes them in its
state), so the request path reads them the same way in either process.
"""

from __future__ import annotations

import time

import grpc

from headrace.v1 import admin_pb2 as apb
from headrace.v1 import inference_pb2 as pb

DEFAULT_UNLOAD_WAIT_S = 30.0   # how long an HTTP unload waits for the adapter's requests


class ModelNotFound(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.code, self.message = grpc.StatusCode.NOT_FOUND, message


def adapters_of(engine) -> dict[str, pb.LoraAdapter]:
    lister = getattr(engine, "lora_adapters", None)
    return {a.name: a for a in lister()} if lister is not None else {}


def lora_of(model: str, base_names, engine, base_name: str = "") -> str:
    """The adapter a request's ``model`` names ("" for the base model: empty, or one of
    ``base_names``); ``ModelNotFound`` for any other name; ValueError (INVALID_ARGUMENT) for an
    adapter the data planes refused."""
    if not model or model in base_names:
        return ""
    adapter = adapters_of(engine).get(model)
    if adapter is None:
        served = sorted(adapters_of(engine))
        extra = f" and the LoRA adapters {', '.join(map(repr, served))}" if served else ""
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                            f"{base_name!r}{extra}")
    if adapter.error:
        raise ValueError(f"model: LoRA adapter {model!r} cannot be served: {adapter.error}")
    return model


def model_cards(path) -> list[dict]:
    """``/v1/models``: the base model, then each adapter (``parent``: the base model)."""
    created, engine = int(time.time()), path.engine
    common = {"object": "model", "created": created, "owned_by": "headrace",
              "max_model_len": engine.max_model_len,
              "deterministic": bool(engine.info and engine.info.deterministic)}   # docs/determinism.md
    cards = [{"id": path.model_name, "root": path.model_dir, "parent": None, **common}]
    for adapter in adapters_of(engine).values():
        cards.append({"id": adapter.name, "root": adapter.path, "parent": path.model_name, **common})
    return cards


class AdminError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class LoraAdmin:
    """Runtime load / unload of adapters for the HTTP routes: through ``plane`` (an engine's
    ``EnginePlane``, in process) or ``stubs`` (the engine cores' Admin stubs, from a front end;
    ``metadata``: the admin token and core secret they need)."""

    def __init__(self, plane=None, stubs=(), metadata=()):
        self.plane, self.stubs, self.metadata = plane, list(stubs), list(metadata)

    async def load(self, name: str, path: str) -> apb.LoraAdapters:
        if self.plane is not None:
            return await call_local(self.plane, "load", name, path)
        return await self._remote("LoadLoraAdapter", apb.LoadLoraAdapterRequest(lora_name=name,
                                                                                lora_path=path))

    async def unload(self, name: str, wait_s: float) -> apb.LoraAdapters:
        if self.plane is not None:
            return await call_local(self.plane, "unload", name, wait_s)
        return await self._remote("UnloadLoraAdapter", apb.UnloadLoraAdapterRequest(lora_name=name,
                                                                                    wait_s=wait_s))

    async def _remote(self, method: str, request):
        import asyncio

        answers = await asyncio.gather(*(getattr(stub, method)(request, metadata=self.metadata)
                                         for stub in self.stubs), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, grpc.aio.AioRpcError):
                raise AdminError(answer.code(), answer.details() or answer.code().name)
            if isinstance(answer, BaseException):
                raise answer
        return answers[0]


def restorer(stub, metadata):
    """A front end's ``CoreClient.restore_adapters`` for the core behind ``stub`` (its Admin
    stub): loads each (name, path) the lost core served; a name loaded already (by another
    front end, or from ``--lora-modules``) is fine, any other refusal is logged once."""
    import logging

    log = logging.getLogger("headrace.lora")

    async def restore(missing: list[tuple[str, str]]) -> None:
        for name, path in missing:
            try:
                await stub.LoadLoraAdapter(apb.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
                                           metadata=metadata, timeout=600)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                    log.warning("LoRA adapter %s not loaded again after the core restarted: %s",
                                name, exc.code().name)
        log.info("LoRA adapters of the lost engine core asked of the restarted one: %d", len(missing))

    return restore


async def call_local(plane, what: str, name: str, arg) -> apb.LoraAdapters:
    """Admin's LoRA operations on an ``EnginePlane`` (AdminError with the refusal's status)."""
    from headrace.controlplane import model_roots
    from headrace.controlplane.lora.registry import LoraError

    engine = plane.engine
    # the admin token authorizes a load (vLLM's rule); an operator's own --model-root limits it
    # further, as it limits ReloadModel (by default the adapter may lie anywhere)
    if what == "load" and arg and plane.model_roots_given and \
            not model_roots.allowed(arg, plane.model_roots):
        raise AdminError(grpc.StatusCode.PERMISSION_DENIED,
                         model_roots.refusal(arg).replace("model ", "lora_path ", 1))
    try:
        if what == "load":
            await engine.lora.register(name, arg)
        else:
            await engine.lora.unregister(name, arg)
    except LoraError as exc:
        raise AdminError(exc.code, exc.message) from None
    plane.changed()   # the front ends learn the new list
    return listing(engine)


def listing(engine) -> apb.LoraAdapters:
    """``ListLoraAdapters``: every adapter with its sequences running and waiting."""
    out = apb.LoraAdapters(max_loras=engine.lora.max_loras, max_cpu_loras=engine.lora.max_cpu_loras,
                           max_lora_rank=engine.lora.max_rank)
    counts = usage(engine)
    for a in engine.lora.adapters():
        running, waiting = counts.get(a.name, (0, 0))
        out.adapters.add(adapter=pb.LoraAdapter(name=a.name, path=a.path, rank=a.rank,
                                                cache_root=a.root, error=a.error),
                         running=running, waiting=waiting, in_slot=a.slot is not None, cached=a.cached)
    return out


def usage(engine) -> dict[str, tuple[int, int]]:
    """adapter name -> (sequences running, sequences waiting)."""
    sched = engine.scheduler
    out: dict[str, list[int]] = {}
    if sched is None:
        return {}
    for seqs, i in ((sched.running, 0), (sched.waiting, 1)):
        for seq in seqs:
            if seq.lora is not None:
                out.setdefault(seq.lora.name, [0, 0])[i] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}
