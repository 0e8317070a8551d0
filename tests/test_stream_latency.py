"""The client-facing latencies (``headrace.controlplane.requests.stream_latency``) as the request
path hands responses over: TTFT once per request at its first token, ITL per sample with a coalesced
burst spread over its tokens, nothing for responses without tokens, e2e only when asked."""

from __future__ import annotations

import time

import pytest

from headrace.controlplane.metrics import ControlPlaneMetrics
from headrace.controlplane.requests.stream_latency import StreamLatency
from headrace.v1 import inference_pb2 as pb

P = "headrace:"


def _sample(metrics, name):
    return metrics.registry.get_sample_value(P + name) or 0.0


def _msg(index, n, finish=pb.FINISH_REASON_UNSPECIFIED):
    return pb.GenerateResponse(index=index, token_ids=list(range(n)), finish_reason=finish)


def test_ttft_itl_and_e2e_of_a_stream(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    m = ControlPlaneMetrics()
    latency = StreamLatency(m)            # received at 100.0
    clock[0] = 100.5
    latency.handing([])                  # a wake-up with nothing new: no observation
    latency.handing([_msg(0, 0)])        # no tokens either
    assert _sample(m, "time_to_first_token_seconds_count") == 0
    clock[0] = 101.0
    latency.handing([_msg(0, 2), _msg(1, 1)])   # the first tokens of two samples
    assert _sample(m, "time_to_first_token_seconds_count") == 1
    assert _sample(m, "time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert _sample(m, "inter_token_latency_seconds_count") == 0   # no gap yet
    clock[0] = 101.4
    latency.handing([_msg(0, 4)])        # a burst of 4 after 0.4 s: 4 x 0.1 s
    clock[0] = 101.6
    now = latency.handing([_msg(1, 1, pb.FINISH_REASON_LENGTH), _msg(0, 0, pb.FINISH_REASON_LENGTH)])
    assert _sample(m, "time_to_first_token_seconds_count") == 1   # once per request
    assert _sample(m, "inter_token_latency_seconds_count") == 4 + 1
    assert _sample(m, "inter_token_latency_seconds_sum") == pytest.approx(0.4 + 0.6)
    buckets = {le: m.registry.get_sample_value(P + "inter_token_latency_seconds_bucket", {"le": le})
               for le in ("0.075", "0.15", "0.5", "0.75")}
    assert buckets == {"0.075": 0, "0.15": 4, "0.5": 4, "0.75": 5}   # 4 x 0.1 s, 1 x 0.6 s
    assert _sample(m, "e2e_request_latency_seconds_count") == 0
    latency.finished(now)
    assert _sample(m, "e2e_request_latency_seconds_count") == 1
    assert _sample(m, "e2e_request_latency_seconds_sum") == pytest.approx(1.6)
