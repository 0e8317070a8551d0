"""Where a request's first token spends its time, from the stamps of ``headrace.common.stage_times``
(the server's processes write them when ``HEADRACE_STAGE_TIMES`` names a directory; the client
adds its own with ``ClientStamps``). Used by ``bench.core_overhead`` and ``bench.serving_bench``
(``--workload w2``); every stage is a difference of two stamps on the host's one monotonic
clock, medians over the requests, in ms:

| stage | from -> to |
| --- | --- |
| frontend_receive | the client's call -> the front end's handler has the request |
| frontend_tokenize_submit | -> tokenized, validated and submitted (to the core's stream, or to the engine in one process) |
| to_core | -> the engine core has it (the front end's ``Up`` message; ~0 in one process) |
| core_admission_scheduling | -> the step computing its (last) prompt chunk is scheduled (waiting for the loop, queueing, earlier chunks) |
| core_to_dataplane_send | -> that step is encoded and queued on the data plane's stream |
| transport_and_hold | the step's round trip minus the data plane's execute time: both gRPC hops, and a step the worker held back until it launched the next one |
| dataplane_host | execute time minus device time: the data plane's host work (inputs, launches, waiting for the device, readback) |
| device_prefill | device time (first op to last) minus sampling (a GPU only; 0 on a CPU, where the forward pass is host time) |
| sample_readback | sampling and the ids' copy to the host (device time on a GPU, host time on a CPU) |
| core_fold | the step's result read -> its first token folded into the sequence |
| core_to_frontend | -> the front end hands the first response to the client's stream (the core's flush, the ``Down`` message, the front end's apply and detokenization) |
| frontend_send | -> the client has it |

They add up to the client's TTFT (``ttft``, printed beside their sum)."""

from __future__ import annotations

import statistics

from headrace.common.stage_times import StageLog, read

STAGES = ["frontend_receive", "frontend_tokenize_submit", "to_core", "core_admission_scheduling",
          "core_to_dataplane_send", "transport_and_hold", "dataplane_host", "device_prefill",
          "sample_readback", "core_fold", "core_to_frontend", "frontend_send"]


class ClientStamps(StageLog):
    """The client's side: when it called and when the first response arrived."""

    def sent(self, request_id: str) -> None:
        self.stamp(request_id, "client_sent")

    def first(self, request_id: str) -> None:
        self.stamp(request_id, "client_first")


def _one(stamps: dict[str, float], steps: list[tuple[float, str, dict]], step_at: dict) -> dict | None:
    """One request's stages (None when a stamp is missing)."""
    need = ("client_sent", "fe_received", "fe_submitted", "core_received", "core_first_token",
            "fe_first_response", "client_first")
    if any(k not in stamps for k in need):
        return None
    ft = stamps["core_first_token"]
    results = [(t, sid, v) for t, sid, v in steps if t <= ft]
    if not results:
        return None
    t_result, sid, v = results[-1]   # the step whose result carried the first token
    scheduled, sent = step_at.get((sid, "scheduled")), step_at.get((sid, "sent"))
    if scheduled is None or sent is None:
        return None
    execute, device, sample = v.get("execute_ms", 0.0), v.get("device_ms", 0.0), v.get("sample_ms", 0.0)
    ms = lambda a, b: (stamps[b] if isinstance(b, str) else b) * 1e3 - (stamps[a] if isinstance(a, str) else a) * 1e3  # noqa: E731
    return {"frontend_receive": ms("client_sent", "fe_received"),
            "frontend_tokenize_submit": ms("fe_received", "fe_submitted"),
            "to_core": ms("fe_submitted", "core_received"),
            "core_admission_scheduling": ms("core_received", scheduled),
            "core_to_dataplane_send": ms(scheduled, sent),
            "transport_and_hold": ms(sent, t_result) - execute,
            "dataplane_host": execute - max(device, sample),
            "device_prefill": device - sample if device else 0.0,
            "sample_readback": sample,
            "core_fold": ms(t_result, "core_first_token"),
            "core_to_frontend": ms("core_first_token", "fe_first_response"),
            "frontend_send": ms("fe_first_response", "client_first"),
            "ttft": ms("client_sent", "client_first")}


def decompose(directory: str, request_ids: list[str]) -> dict:
    """Median ms of each stage over ``request_ids`` (and ``requests``: how many had every
    stamp; ``sum``: the medians added up, beside ``ttft``, the median TTFT)."""
    per_request: dict[str, dict[str, float]] = {r: {} for r in request_ids}
    steps, step_at = [], {}
    for t, key, stage, values in read(directory):
        if key.startswith("step:"):
            step_at[(key, stage)] = t
            if stage == "result":
                steps.append((t, key, values))
        elif key in per_request:
            per_request[key].setdefault(stage, t)   # the first of each (a flush may repeat)
    rows = [r for r in (_one(s, steps, step_at) for s in per_request.values()) if r is not None]
    if not rows:
        return {"requests": 0}
    out = {k: round(statistics.median(r[k] for r in rows), 3) for k in STAGES + ["ttft"]}
    out["sum"] = round(sum(out[k] for k in STAGES), 3)
    out["requests"] = len(rows)
    return out


def table(stages: dict) -> str:
    """The decomposition as a two-column markdown table."""
    lines = ["| first-token stage | ms (median) |", "| --- | ---: |"]
    lines += [f"| {k} | {stages[k]:.3f} |" for k in STAGES if k in stages]
    lines.append(f"| sum / TTFT | {stages.get('sum', 0):.3f} / {stages.get('ttft', 0):.3f} |")
    return "\n".join(lines)
