"""How a front end applies its engine core's ``Down`` messages to its requests (``DownMessages``, a
part of ``headrace.controlplane.frontend.client.CoreClient``): the token columns and deltas appended
to the local sequences (stop strings matched here; a match finishes the sample here and, by an
``Abort``, in the core), failures handed to the requests (or offered to ``on_failed``: under data
parallelism a request may go on on another core), the core's state and, for placement, its load and
prefix-cache changes. Then every request with news is woken."""

from __future__ import annotations

import grpc

from headrace.controlplane.requests.request import Failure, Request, Sequence, Status
from headrace.core.v1 import core_pb2 as cpb
from headrace.v1 import inference_pb2 as pb


class DownMessages:
    def _apply(self, down: cpb.Down) -> None:
        if down.HasField("state"):
            self._set_state(down.state)
        if down.HasField("load"):
            load = down.load
            self.view.apply(load.cache_reset, load.cached_hashes, load.evicted_hashes)
            self.core_load = cpb.CoreLoad(running=load.running, waiting=load.waiting,
                                          num_kv_blocks=load.num_kv_blocks,
                                          num_free_kv_blocks=load.num_free_kv_blocks,
                                          block_size=load.block_size,
                                          lora_in_slots=load.lora_in_slots,
                                          lora_cached=load.lora_cached)
            self.placed_since_report = 0
        self._queue.num_queued = down.num_waiting
        woken, by_handle = {}, self._by_handle
        if down.token_handles:   # the columns first (a sample's deltas follow its columns)
            tokens, pos = list(down.token_ids), 0
            for handle, index, count in zip(down.token_handles, down.token_indexes, down.token_counts):
                request, end = by_handle.get(handle), pos + count
                if request is not None and index < len(request.sequences):
                    seq = request.sequences[index]
                    if seq.output.has_stop:
                        self._append(request, seq, tokens[pos:end])
                    elif seq.status is not Status.FINISHED:   # (as ``_append``, no stop strings)
                        seq.output_token_ids += tokens[pos:end]
                    woken[request] = None
                pos = end
        for d in down.deltas:
            request = by_handle.get(d.handle)
            if request is not None and d.index < len(request.sequences):
                self._append(request, request.sequences[d.index], d.token_ids, d)
                woken[request] = None
        for f in down.failed:
            request = self._by_handle.pop(f.handle, None)
            if request is not None:
                self.requests.pop(request.request_id, None)
                failure = Failure(_status(f.code), f.message)
                if self.on_failed is None or not self.on_failed(self, request, failure):
                    request.fail(failure)
        for request in woken:
            if request.finished:
                self._by_handle.pop(request.core_handle, None)
                self.requests.pop(request.request_id, None)
            request.notify()

    def _append(self, request: Request, seq: Sequence, token_ids, d: cpb.SeqDelta | None = None) -> None:
        """Appends ``token_ids`` (a column entry's, or ``d``'s with its logprobs and finish)."""
        if seq.finished:   # stopped here by a stop string; the core's later tokens are dropped
            return
        out = seq.output_token_ids
        out.extend(token_ids)
        finish_reason = d.finish_reason if d is not None else pb.FINISH_REASON_UNSPECIFIED
        if d is not None and d.logprobs:
            seq.logprobs.extend((lp.logprob, [t.token_id for t in lp.top], [t.logprob for t in lp.top])
                                for lp in d.logprobs)
        if seq.output.has_stop:   # a stop token's own text is not matched (as in Sequence.check_stop)
            upto = len(out) - 1 if finish_reason == pb.FINISH_REASON_STOP else len(out)
            if seq._feed_text(upto):
                del out[seq.text_fed:]
                del seq.logprobs[seq.text_fed:]
                self._finish(seq, pb.FINISH_REASON_STOP_STRING)
                self._up.aborts.add(handle=request.core_handle, reason=pb.FINISH_REASON_STOP_STRING,
                                    index=seq.index)
                self._up_ready.set()
                return
        if finish_reason:
            seq.num_cached_prompt_tokens = d.cached_prompt_tokens
            self._finish(seq, finish_reason)

    @staticmethod
    def _finish(seq: Sequence, reason: int) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason

def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN
