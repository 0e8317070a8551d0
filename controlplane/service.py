"""The public ``headrace.v1.Inference`` service: validates, tokenizes, submits to the engine
and streams each request's responses; a client that leaves aborts its request."""

from __future__ import annotations

import grpc
import structlog

from controlplane import tracing
from controlplane.engine import Engine
from controlplane.logs import get_logger
from controlplane.metrics import rpc_status
from controlplane.tokenizer import ModelTokenizer
from controlplane.validation import MAX_PROMPT_CHARS, ValidationError, build_request
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

log = get_logger("headrace.service")


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, engine: Engine, tokenizer: ModelTokenizer, tensor_parallel_size: int = 1,
                 log_prompts: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.tp = tensor_parallel_size
        self.log_prompts = log_prompts

    async def _require_ready(self, context) -> None:
        if self.engine.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        if not self.engine.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is not ready (loading or data plane down)")

    async def Generate(self, request: pb.GenerateRequest, context):
        trace_id = tracing.request_trace_id(context.invocation_metadata())
        structlog.contextvars.bind_contextvars(request_id=request.request_id, trace_id=trace_id)
        engine = self.engine
        try:
            await self._require_ready(context)
            if engine.config.max_queued and len(engine.scheduler.waiting) >= engine.config.max_queued:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"queue is full ({engine.config.max_queued} waiting); retry later")
            try:
                req = build_request(request, self.tokenizer, seq_ids=engine.seq_ids,
                                    vocab_size=engine.info.vocab_size,
                                    max_model_len=engine.max_model_len,
                                    eos_token_ids=list(engine.info.eos_token_ids))
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if req.request_id in engine.requests:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request_id {req.request_id!r} is already in use")
            structlog.contextvars.bind_contextvars(request_id=req.request_id)
            if self.log_prompts:
                log.info("request received", prompt=request.prompt or None,
                         prompt_token_ids=list(req.sequences[0].prompt_token_ids))
            engine.submit(req)
            try:
                while not req.delivered:
                    responses = await req.next_responses()
                    if req.failure is not None:
                        await context.abort(req.failure.code, req.failure.message)
                    for msg in responses:
                        yield msg
            finally:
                engine.abort(req)  # no-op when finished; frees the blocks when the client left
        except BaseException as exc:
            code = rpc_status(context, exc)
            engine.telemetry.metrics.rpc_error("Generate", code)
            tracing.mark_span_failed(code)
            log.info("request failed", code=code.name, details=context.details() or repr(exc))
            raise

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        if len(request.text) > MAX_PROMPT_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"text is longer than {MAX_PROMPT_CHARS} characters")
        ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.tokens(ids))

    async def GetModelInfo(self, request, context):
        if not self.engine.healthy:   # answers while draining: the model is still there
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is not ready (loading or data plane down)")
        info, blocks = self.engine.info, self.engine.scheduler.blocks
        return pb.ModelInfo(model_name=info.model_name, architecture=info.architecture,
                            max_model_len=self.engine.max_model_len, vocab_size=info.vocab_size,
                            dtype=info.dtype, device=info.device, tensor_parallel_size=self.tp,
                            kv_block_size=blocks.block_size, num_kv_blocks=blocks.num_blocks,
                            eos_token_ids=list(info.eos_token_ids),
                            kv_cache_dtype=info.kv_cache_dtype, quantization=info.quantization)
