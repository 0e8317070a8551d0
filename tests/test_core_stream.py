"""The core's ``Down`` messages, without processes or sockets: whatever the engine appends and
finishes, however many steps' flushes pile up in one message (a slow reader) and whichever
samples ask for logprobs, the front end's ``CoreClient`` ends with exactly the core's tokens,
logprobs and finish reasons, and each request's last delta releases it on both sides
(hypothesis). Tokens of samples that run on travel in the message's columns, a sample's last
ones and tokens with logprobs as ``SeqDelta``s."""

from __future__ import annotations

import asyncio
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.core.service import CoreRequest, CoreText, FrontendLink
from headrace.controlplane.frontend.client import CoreClient
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.requests.request import Request, Sequence, Status
from headrace.core.v1 import core_pb2 as cpb
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb


class _Text:
    def step(self, token_id):
        return ""

    def flush(self):
        return ""


def _seq(request, index: int, logprobs: int, output) -> Sequence:
    return Sequence(request=request, seq_id=index, index=index, prompt_token_ids=[5, 6],
                    sampling=wpb.Sampling(logprobs=logprobs), max_tokens=1000, output=output,
                    status=Status.RUNNING)


# per request: (samples, logprobs wanted); then events: (request, sample, tokens, finish, take)
REQUESTS = st.lists(st.tuples(st.integers(1, 3), st.sampled_from([0, 0, 2])), min_size=1, max_size=4)
EVENTS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 3), st.booleans(),
                            st.booleans()), max_size=40)


@settings(max_examples=150, deadline=None)
@given(REQUESTS, EVENTS)
def test_front_end_gets_exactly_the_cores_tokens(requests, events):
    asyncio.run(_run(requests, events))


async def _run(requests, events):
    plane = types.SimpleNamespace(engine=types.SimpleNamespace(scheduler=None))
    link, client = FrontendLink(plane), CoreClient("unix:/nonexistent", 0, None)
    pairs = []
    for handle, (n, logprobs) in enumerate(requests, start=1):
        req = CoreRequest(request_id=f"r{handle}", n=n, link=link, handle=handle)
        req.sequences = [_seq(req, i, logprobs, CoreText(False)) for i in range(n)]
        mirror = Request(request_id=req.request_id, n=n)
        mirror.sequences = [_seq(mirror, i, logprobs, OutputText(_Text(), [])) for i in range(n)]
        mirror.core_handle = handle
        link.requests[handle] = req
        client.requests[mirror.request_id], client._by_handle[handle] = mirror, mirror
        pairs.append((req, mirror))

    async def take():
        link.flush()
        client._apply(cpb.Down.FromString((await link.next_message()).SerializeToString()))

    token = 10
    for r, i, k, finish, taken in events:
        req, _ = pairs[r % len(pairs)]
        seq = req.sequences[i % len(req.sequences)]
        if not seq.finished:
            for _ in range(k):
                seq.output_token_ids.append(token)
                if seq.sampling.logprobs:
                    seq.logprobs.append((-0.5, [token, token + 1], [-0.5, -1.5]))
                token += 1
            if finish:
                seq.status, seq.finish_reason = Status.FINISHED, pb.FINISH_REASON_LENGTH
            req.notify()
        if taken:
            await take()
    for req, _ in pairs:   # the rest finish
        for seq in req.sequences:
            if not seq.finished:
                seq.status, seq.finish_reason = Status.FINISHED, pb.FINISH_REASON_STOP
        req.notify()
    await take()
    for req, mirror in pairs:
        for core_seq, seq in zip(req.sequences, mirror.sequences):
            assert seq.output_token_ids == core_seq.output_token_ids
            assert [lp[0] for lp in seq.logprobs] == [lp[0] for lp in core_seq.logprobs]
            assert [list(lp[1]) for lp in seq.logprobs] == [list(lp[1]) for lp in core_seq.logprobs]
            assert seq.finished and seq.finish_reason == core_seq.finish_reason
        assert mirror.finished
    assert not link.requests and not client.requests and not client._by_handle
