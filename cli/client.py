"""A small streaming client for ``headrace generate``: waits for the server to be SERVING,
then prints text as it arrives."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc


async def wait_until_serving(channel: grpc.aio.Channel, timeout: float) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.25)
    return False


async def stream_generate(args) -> int:
    async with grpc.aio.insecure_channel(args.address) as channel:
        if not await wait_until_serving(channel, args.wait):
            print(f"headrace: server at {args.address} not ready after {args.wait:.0f}s", file=sys.stderr)
            return 2
        sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k)
        if args.top_p is not None:
            sampling.top_p = args.top_p
        if args.seed is not None:
            sampling.seed = args.seed
        request = pb.GenerateRequest(prompt=args.prompt, sampling=sampling,
                                     max_tokens=args.max_tokens, stop=args.stop)
        try:
            async for resp in pb_grpc.InferenceStub(channel).Generate(request):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                if resp.finish_reason:
                    reason = pb.FinishReason.Name(resp.finish_reason).removeprefix("FINISH_REASON_")
                    print(f"\n[{reason.lower()}: {resp.usage.completion_tokens} tokens]", file=sys.stderr)
        except grpc.aio.AioRpcError as exc:
            print(f"\nheadrace: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
