"""A launched step's StepResult (``ModelRunner.finish``): waits for the step's device work,
reads its sampled ids back, gives them to the worker's mirror (the histories of rows with
penalties, the stop rule's verdict, the token mirror, a verify's accepted drafts) and reports
the step's device, sampling, idle and host times, and the host tier's copies."""

from __future__ import annotations

import time

import numpy as np

from headrace.dataplane.input_batch import InputBatch
from headrace.dataplane.launched import Launched
from headrace.dataplane.spec_decode import SpecDecoder
from headrace.worker.v1 import worker_pb2 as pb


def build(batch: InputBatch, seq_of_row: np.ndarray, host_kv, launched: Launched) -> pb.StepResult:
    result = pb.StepResult(step_id=launched.step_id)
    if launched.out is not None:
        if launched.done is not None:
            launched.done.synchronize()
            result.device_ms = launched.begin.elapsed_time(launched.done)
            if launched.previous is not None:
                result.device_idle_ms = max(0.0, launched.previous.elapsed_time(launched.begin))
            result.sample_ms = launched.sample_begin.elapsed_time(launched.done)
        else:
            result.sample_ms = launched.sample_ms
        ready = time.perf_counter()   # the device is done: what follows is host time
        tokens, logprobs, top_ids, top_vals = launched.out.to_host()
        if launched.verified is not None:
            done = SpecDecoder.finish(batch, launched.verified, launched.seq_ids, tokens,
                                      logprobs, top_ids, top_vals, result)
            rows = launched.verified.rows
            for i, emitted in done:
                batch.sampling[int(rows[i])].output_token_ids.extend(emitted)
            logprobs = None
        else:
            for i, row_state in launched.histories:
                row_state.output_token_ids.append(tokens[i])
            result.stopped_seq_ids.extend(batch.mark_stopped(launched.stop_watch, tokens))
            result.seq_ids.extend(launched.seq_ids)
            result.token_ids.extend(tokens)
            if launched.token_pos is not None:   # rows still held by the same sequences
                rows = launched.token_rows
                same = seq_of_row[rows] == np.asarray(launched.seq_ids, dtype=np.int64)
                batch.record(rows[same], launched.token_pos[same], np.asarray(tokens)[same])
        if logprobs is not None:
            result.logprobs.extend(logprobs)
            for ids, vals in zip(top_ids, top_vals):
                result.top_token_ids.extend(ids)
                result.top_logprobs.extend(vals)
    if host_kv is not None:
        result.swap_ms, result.swap_out_bytes, result.swap_in_bytes = host_kv.drain()
    end = time.perf_counter()
    result.execute_ms = (end - launched.started) * 1e3
    if launched.out is not None:
        launched.host_ms["finish"] = (end - ready) * 1e3
    return result
