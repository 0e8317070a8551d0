"""Fault-injection experiments on a real ``headrace serve`` process tree (``tests.served``), with
streams in flight: what ``tests/test_chaos.py`` asserts and ``bench/chaos.py`` measures at the
issue's sizes (8 streams of 200 tokens). Each experiment returns a dict of what it saw.

- ``kill``: kill -9 of a process kind (``dataplane``, ``core``, ``frontend 0``) mid-stream;
- ``stop``: SIGSTOP of one for some seconds, then SIGCONT (and how soon health said so);
- ``poisoned``: a request whose sampling raises (the ``dataplane.sampler`` failpoint, by its
  seed) beside the other streams: its status, theirs, the log's growth;
- ``abandoned``: streams cancelled after their first token: blocks, requests and memory after;
- ``ctrl_c``: SIGINT to serve with HTTP streams open: their last events, how long the tree took
  to go, the terminal's output.
``check_logs`` reads the server's log: the longest line, lines over 8 KB, prompt token ids."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

POISON_SEED = 666
FAILPOINTS = f"dataplane.sampler=raise(IndexError)@seed={POISON_SEED}"
SERVING = health_pb2.HealthCheckResponse.SERVING


def prompts(n: int) -> list[str]:
    return [f"It is a truth universally acknowledged, said Mr {name}, that"
            for name in ("Bennet", "Darcy", "Bingley", "Collins", "Wickham", "Lucas", "Gardiner",
                         "Hurst", "Phillips", "Denny", "Forster", "Jenkinson")[:n]]


def greedy(prompt: str, tokens: int, seed: int | None = None) -> pb.GenerateRequest:
    """A greedy request, or with ``seed`` a seeded sampled one (temperature 0.8, top-p 0.95)."""
    sampling = pb.SamplingParams(temperature=0) if seed is None else \
        pb.SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    return pb.GenerateRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True, sampling=sampling)


def requests(n: int, tokens: int, seeded: bool = False) -> list[pb.GenerateRequest]:
    return [greedy(p, tokens, 100 + i if seeded else None) for i, p in enumerate(prompts(n))]


class Stream(threading.Thread):
    """One gRPC stream read to its end in a thread: tokens, text, finish reason or error, and
    when each message came."""

    def __init__(self, channel: grpc.Channel, request: pb.GenerateRequest, timeout: float = 180):
        super().__init__(daemon=True)
        self.call = pb_grpc.InferenceStub(channel).Generate(request, timeout=timeout)
        self.tokens: list[int] = []
        self.text, self.finish, self.error = "", 0, None
        self.times: list[float] = []
        self.start()

    def run(self) -> None:
        try:
            for r in self.call:
                self.times.append(time.monotonic())
                self.tokens += r.token_ids
                self.text += r.text
                self.finish = r.finish_reason or self.finish
        except grpc.RpcError as exc:
            self.error = (exc.code().name, exc.details())

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def run_streams(channel, requests, timeout: float = 180) -> list[Stream]:
    return [Stream(channel, r, timeout) for r in requests]


def wait_under_way(streams: list[Stream], tokens: int = 8, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(len(s.tokens) < tokens and s.is_alive() for s in streams):
        assert time.monotonic() < deadline, "the streams did not get under way"
        time.sleep(0.01)


def join(streams: list[Stream], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for s in streams:
        s.join(max(0.0, deadline - time.monotonic()))


def health(channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def reference(served, n: int, tokens: int, seeded: bool = False) -> list[list[int]]:
    """The tokens of an undisturbed run of the experiments' requests."""
    with grpc.insecure_channel(served.address) as channel:
        streams = run_streams(channel, requests(n, tokens, seeded))
        join(streams)
    assert all(s.error is None for s in streams), [s.error for s in streams]
    return [s.tokens for s in streams]


def _summary(streams: list[Stream], expected: list[list[int]] | None) -> dict:
    return {"streams": len(streams),
            "completed": sum(s.error is None and s.finish != 0 for s in streams),
            "errors": [s.error for s in streams if s.error is not None],
            "same_tokens": None if expected is None else sum(s.tokens == e for s, e in zip(streams, expected)),
            "hung": sum(s.is_alive() for s in streams),
            "longest_gap_s": round(max((s.longest_gap() for s in streams), default=0.0), 3)}


def kill(served, role: str, expected: list[list[int]], tokens: int, seeded: bool = False) -> dict:
    """kill -9 of ``role`` with len(expected) streams in flight (greedy, or ``seeded``; for
    ``frontend 0``, half of them on the victim, half on front end 1)."""
    n = len(expected)
    if role.startswith("frontend"):
        victim, other = served.channel_to(0), served.channel_to(1)
        channels = [victim if i % 2 == 0 else other for i in range(n)]
    else:
        channels = [grpc.insecure_channel(served.address) for _ in range(n)]
    streams = [Stream(c, r) for c, r in zip(channels, requests(n, tokens, seeded))]
    wait_under_way(streams)
    pid = served.role_pids()[role]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    join(streams)
    out = _summary(streams, expected)
    served.wait_for(lambda: served.role_pids().get(role) not in (None, pid), 60, f"{role} restarted")
    with grpc.insecure_channel(served.address) as channel:
        served.wait_for(lambda: health(channel) == SERVING, 60, "SERVING again")
    out.update(role=role, seeded=seeded, back_s=round(time.monotonic() - t0, 2))
    if role.startswith("frontend"):
        out["victim_errors"] = [s.error[0] for i, s in enumerate(streams) if i % 2 == 0 and s.error]
        out["others_same"] = sum(s.tokens == e for i, (s, e) in enumerate(zip(streams, expected)) if i % 2)
    return out


def stop(served, role: str, expected: list[list[int]], tokens: int, seconds: float) -> dict:
    """SIGSTOP of ``role`` for ``seconds`` with the streams in flight, then SIGCONT: when
    health (and, with an HTTP port, /ready) said NOT_SERVING, and how the streams ended."""
    n = len(expected)
    channels = [served.channel_to(0) if role == "frontend 0" else grpc.insecure_channel(served.address)
                for _ in range(n)]
    probe = served.channel_to(1) if role == "frontend 0" else grpc.insecure_channel(served.address)
    streams = [Stream(c, greedy(p, tokens)) for c, p in zip(channels, prompts(n))]
    wait_under_way(streams)
    pid = served.role_pids()[role]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    not_serving = ready_503 = None
    try:
        while time.monotonic() - t0 < seconds:
            if not_serving is None and health(probe) not in (SERVING, None):
                not_serving = time.monotonic() - t0
            if ready_503 is None and getattr(served, "http_port", None) and _ready(served) == 503:
                ready_503 = time.monotonic() - t0
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    join(streams)
    out = _summary(streams, expected)
    out.update(role=role, stopped_s=seconds,
               not_serving_after_s=None if not_serving is None else round(not_serving, 2),
               ready_503_after_s=None if ready_503 is None else round(ready_503, 2))
    served.wait_for(lambda: health(probe) == SERVING, 60, "SERVING again")
    probe.close()
    return out


def _ready(served) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/ready", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def poisoned(served, expected: list[list[int]], tokens: int) -> dict:
    """A request whose sampling raises (seed POISON_SEED) beside len(expected) - 1 streams."""
    n = len(expected) - 1
    log_before = os.path.getsize(served.log.name)
    channel = grpc.insecure_channel(served.address)
    streams = run_streams(channel, [greedy(p, tokens) for p in prompts(n)])
    wait_under_way(streams)
    t0 = time.monotonic()
    bad = Stream(channel, pb.GenerateRequest(prompt="Poisoned", max_tokens=tokens, ignore_eos=True,
                                             sampling=pb.SamplingParams(temperature=0.8, seed=POISON_SEED)))
    bad.join(60)
    failed_after = time.monotonic() - t0
    join(streams)
    out = _summary(streams, expected[:n])
    after = Stream(channel, greedy(prompts(1)[0], 16))
    after.join(60)
    served.log.flush()
    out.update(poisoned_error=bad.error, poisoned_failed_after_s=round(failed_after, 2),
               poisoned_tokens=len(bad.tokens), next_request_ok=after.error is None and len(after.tokens) == 16,
               log_growth_bytes=os.path.getsize(served.log.name) - log_before)
    channel.close()
    return out


def abandoned(served, count: int, tokens: int = 200) -> dict:
    """``count`` streams cancelled after their first token, in waves of 50: memory, blocks and
    requests in flight afterwards."""
    rss = lambda: {r: psutil.Process(p).memory_info().rss for r, p in served.role_pids().items()}  # noqa: E731
    before = rss()
    channel = grpc.insecure_channel(served.address)
    stub = pb_grpc.InferenceStub(channel)
    for wave in range(0, count, 50):
        calls = [stub.Generate(greedy(f"Abandoned {wave + i}", tokens), timeout=60)
                 for i in range(min(50, count - wave))]
        for call in calls:
            next(call)
        for call in calls:
            call.cancel()
    served.wait_for(lambda: served.metric("headrace:num_requests_in_flight") == 0
                    and served.metric("headrace:kv_cache_usage_perc") == 0.0, 30, "everything freed")
    after = rss()
    channel.close()
    return {"abandoned": count, "in_flight_after": served.metric("headrace:num_requests_in_flight"),
            "kv_usage_after": served.metric("headrace:kv_cache_usage_perc"),
            "rss_growth_mb": {r: round((after[r] - before.get(r, after[r])) / 2 ** 20, 1) for r in after}}


def ctrl_c(served, n: int, tokens: int, drain_timeout: float) -> dict:
    """SIGINT to serve with ``n`` HTTP streams open (each longer than the drain timeout)."""
    import httpx

    results: list[dict] = [{} for _ in range(n)]

    def read(i: int) -> None:
        body = {"prompt": prompts(n)[i], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = []
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{served.http_port}/v1/completions", json=body,
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as exc:
            results[i]["transport_error"] = type(exc).__name__
        results[i].update(events=len(events), last=events[-1] if events else None,
                          error_event=next((json.loads(e)["error"]["message"] for e in events
                                            if e.startswith('{"error"')), None),
                          ended_at=time.monotonic())

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    served.wait_for(lambda: served.metric("headrace:num_requests_running") >= n, 60, "streams running")
    root = psutil.Process(served.proc.pid)
    tree = [root] + root.children(recursive=True)
    served.log.flush()
    log_at_signal = os.path.getsize(served.log.name)
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(drain_timeout + 10)
    gone = None
    deadline = t0 + drain_timeout + 15
    while time.monotonic() < deadline:
        served.proc.poll()   # (reaps serve itself once it exits)
        if not any(_alive(p) for p in tree):
            gone = time.monotonic() - t0
            break
        time.sleep(0.05)
    served.proc.wait(5)
    return {"streams": n, "done_events": sum(r.get("last") == "[DONE]" for r in results),
            "error_events": sum(r.get("error_event") is not None for r in results),
            "transport_errors": sum("transport_error" in r for r in results),
            "last_stream_end_s": round(max(r.get("ended_at", t0) for r in results) - t0, 2),
            "tree_gone_s": None if gone is None else round(gone, 2), "drain_timeout_s": drain_timeout,
            "tracebacks_after_signal": _tracebacks(served.log.name, log_at_signal)}


def _tracebacks(path: str, offset: int) -> int:
    """Lines from ``offset`` on with a traceback (a raw one, or a JSON line's ``exception``)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return sum(b"Traceback" in line or b'"exception"' in line for line in f.read().splitlines())


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def check_logs(path: str, prompt_token_ids: list[list[int]] = ()) -> dict:
    """The longest log line, lines over 8 KB, lines without ``role``, and whether any prompt's
    token ids appear (as a list's run of six)."""
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    runs = [", ".join(map(str, ids[:6])) for ids in prompt_token_ids if len(ids) >= 6]
    text = b"\n".join(lines).decode("utf-8", "replace")
    no_role = 0
    for line in lines:
        if line.startswith(b"{"):
            try:
                no_role += "role" not in json.loads(line)
            except ValueError:
                pass
    return {"lines": len(lines), "longest_line": max(map(len, lines), default=0),
            "over_8kb": sum(len(line) > 8192 for line in lines), "without_role": no_role,
            "prompt_ids_found": sum(bool(re.search(re.escape(r), text)) for r in runs)}


def serve_argv_extra(http_port: int, floor_s: float = 5.0, hang_s: float = 60.0,
                     drain_s: float = 10.0) -> tuple[str, ...]:
    return ("--http-port", str(http_port), "--step-timeout-floor", str(floor_s),
            "--step-hang-timeout", str(hang_s), "--drain-timeout", str(drain_s))
