"""The public ``headrace.v1.Inference`` gRPC service: a thin front end of
``headrace.controlplane.requests.path`` (which validates, tokenizes, submits and streams); a client
that leaves aborts its request."""

from __future__ import annotations

import contextlib

import grpc

from headrace.common import tracing
from headrace.common.logs import get_logger
from headrace.controlplane.requests import wire_check
from headrace.controlplane.metrics import rpc_status
from headrace.controlplane.requests.path import RequestError, RequestPath
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

log = get_logger("headrace.service")
NOT_READY = "model is not ready (loading or data plane down)"


# The server's deadline is the client's timeout counted from the call's arrival here, so it
# trails the client's own by the call's way in: when the client's deadline fires (and its
# cancel arrives) the server may still see a few milliseconds left, more on a busy host (a
# 0.5 s deadline was seen counted as a cancel on 2 loaded cores with a 1 ms allowance).
DEADLINE_SLACK_S = 0.05


def _gone_reason(context) -> str:
    """Why a Generate stream stopped early on the client's side: its deadline (within
    ``DEADLINE_SLACK_S`` of it) or a cancel."""
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining <= DEADLINE_SLACK_S else "client_cancel"


class InferenceService(pb_grpc.InferenceServicer):
    """The gRPC front end of ``RequestPath``."""

    def __init__(self, path: RequestPath, tensor_parallel_size: int = 1):
        self.path = path
        self.engine = path.engine
        self.tp = tensor_parallel_size

    async def Generate(self, request: pb.GenerateRequest, context):
        malformed = wire_check.refusal(request)   # (its stream is not wrapped by the check)
        if malformed is not None:
            self.engine.telemetry.metrics.rpc_error("Generate", grpc.StatusCode.INVALID_ARGUMENT, "grpc")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed)
        error = None
        try:
            async with contextlib.aclosing(self.path.generate(
                    request, api="grpc", metadata=context.invocation_metadata() or (),
                    gone_reason=lambda: _gone_reason(context))) as responses:
                async for msg in responses:
                    yield msg
        except RequestError as exc:   # counted and logged by the request path
            error = exc
        except BaseException as exc:  # cancelled, deadline exceeded
            code = rpc_status(context, exc)
            self.engine.telemetry.metrics.rpc_error("Generate", code, "grpc")
            tracing.mark_span_failed(code)
            log.info("request failed", code=code.name, details=context.details() or repr(exc))
            raise
        if error is not None:
            await context.abort(error.code, error.message)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            ids = await self.path.tokenize(request.text, request.add_special_tokens)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        return pb.TokenizeResponse(token_ids=ids, tokens=self.path.tokenizer.tokens(ids))

    async def GetModelInfo(self, request, context):
        if not self.engine.healthy:   # answers while draining: the model is still there
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        return model_info(self.engine, self.tp)


def model_info(engine, tensor_parallel_size: int) -> pb.ModelInfo:
    """What ``GetModelInfo`` answers for a loaded engine."""
    info, blocks = engine.info, engine.scheduler.blocks
    lora = getattr(engine, "lora", None)   # (an engine of LoRA adapters: headrace.controlplane.lora.registry)
    adapters = engine.lora_adapters() if lora is not None else []
    for adapter in adapters:
        adapter.parent = info.model_name
    return pb.ModelInfo(model_name=info.model_name, architecture=info.architecture,
                        max_model_len=engine.max_model_len, vocab_size=info.vocab_size,
                        dtype=info.dtype, device=info.device, tensor_parallel_size=tensor_parallel_size,
                        kv_block_size=blocks.block_size, num_kv_blocks=blocks.num_blocks,
                        eos_token_ids=list(info.eos_token_ids),
                        kv_cache_dtype=info.kv_cache_dtype, quantization=info.quantization,
                        num_host_kv_blocks=blocks.host.num_blocks if blocks.host else 0,
                        lora_adapters=adapters, max_loras=lora.max_loras if lora else 0,
                        max_lora_rank=lora.max_rank if lora else 0,
                        deterministic=info.deterministic)
