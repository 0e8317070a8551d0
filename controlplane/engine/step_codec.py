"""The step protocol's wire codec on the control plane's side: a scheduled step becomes the
``StepRequest`` every worker receives, and rank 0's ``StepResult`` goes back into the
sequences it sampled for (their tokens and logprobs). What a token means to its request
(stop rules, streaming) is the engine's business, not this module's."""

from __future__ import annotations

import typing

from headrace.controlplane.requests.request import Sequence, Status
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.worker.v1 import worker_pb2 as wpb


def encode(step: ScheduledStep, step_id: int, flush: bool) -> wpb.StepRequest:
    """The message for ``step``; ``flush``: the workers answer it at once instead of holding
    it back behind the next one."""
    copies, running = step.copies, step.running
    msg = wpb.StepRequest(step_id=step_id, flush=flush, finished_seq_ids=step.finished_seq_ids,
                          copy_src_blocks=[s for s, _ in copies],
                          copy_dst_blocks=[d for _, d in copies])
    for new in step.new:
        seq = new.seq
        msg.new_seqs.add(seq_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids,
                         output_token_ids=seq.output_token_ids, block_ids=new.block_ids,
                         num_computed_tokens=seq.num_computed, num_scheduled_tokens=new.num_tokens,
                         sampling=seq.sampling,
                         lora_slot=0 if seq.lora is None else seq.lora.slot + 1)
    if running.seqs:
        msg.running_seq_ids.extend([s.seq_id for s in running.seqs])
        msg.running_num_scheduled.extend(running.num_tokens)
        msg.running_new_block_counts.extend(running.new_block_counts)
        msg.running_new_block_ids.extend(running.new_block_ids)
        msg.running_num_spec.extend(running.num_spec)
    if step.truncations:
        msg.truncate_seq_ids.extend([s for s, _ in step.truncations])
        msg.truncate_num_blocks.extend([n for _, n in step.truncations])
    if step.swap_out:
        msg.swap_out_device_blocks.extend([d for d, _ in step.swap_out])
        msg.swap_out_host_blocks.extend([h for _, h in step.swap_out])
    for slot, adapter_id in step.lora_loads:   # (slots are 1-based on the wire)
        msg.lora_loads.add(slot=slot + 1, adapter_id=adapter_id)
    msg.lora_drops.extend(step.lora_drops)
    if step.swap_in:
        msg.swap_in_host_blocks.extend([h for h, _ in step.swap_in])
        msg.swap_in_device_blocks.extend([d for _, d in step.swap_in])
    return msg


def flush_request(step_id: int) -> wpb.StepRequest:
    """An empty step that makes the workers answer the step they hold back."""
    return wpb.StepRequest(step_id=step_id, flush=True)


def decode(step: ScheduledStep, result: wpb.StepResult) -> list[Sequence]:
    """Appends each token of ``result`` (and its logprobs, when the sequence asked for them) to
    its sequence and counts it as arrived; returns those sequences in the result's order. A
    token for a sequence that finished or was aborted while the step was in flight is dropped
    (a wasted slot); a preempted sequence keeps the token it was computing."""
    by_seq = {s.seq_id: s for s, _ in step.scheduled()}
    received: list[Sequence] = []
    top_pos = 0
    for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids)):
        seq = by_seq.get(seq_id)
        k = seq.sampling.logprobs if seq is not None else 0
        if seq is None or seq.status is Status.FINISHED:
            top_pos += k
            continue
        seq.num_inflight -= 1
        seq.output_token_ids.append(token)
        if k:
            seq.logprobs.append((result.logprobs[i], result.top_token_ids[top_pos:top_pos + k],
                                 result.top_logprobs[top_pos:top_pos + k]))
            top_pos += k
        received.append(seq)
    return received


class Verified(typing.NamedTuple):
    """A sequence's share of a speculating step's result (tokens not yet appended)."""
    seq: Sequence
    tokens: list[int]
    logprobs: list       # (logprob, top ids, top values) per token, when it asked
    given: int           # speculative positions it was given
    drafts: int          # drafts the worker proposed


def decode_verified(step: ScheduledStep, result: wpb.StepResult) -> list[Verified]:
    """The result of a speculating step (``result.num_tokens`` set), per sequence (several
    tokens each); the engine appends them one at a time so that a stop drops what follows."""
    by_seq = {s.seq_id: s for s, _ in step.scheduled()}
    given = dict(zip((s.seq_id for s in step.running.seqs), step.running.num_spec))
    out: list[Verified] = []
    pos = top_pos = 0
    for seq_id, n, drafts in zip(result.seq_ids, result.num_tokens, result.num_draft_tokens):
        seq = by_seq.get(seq_id)
        k = seq.sampling.logprobs if seq is not None else 0
        tokens, lps = list(result.token_ids[pos:pos + n]), []
        if k:
            for i in range(pos, pos + n):
                lps.append((result.logprobs[i], result.top_token_ids[top_pos:top_pos + k],
                            result.top_logprobs[top_pos:top_pos + k]))
                top_pos += k
        pos += n
        if seq is None or seq.status is Status.FINISHED:
            continue
        seq.num_inflight -= 1
        out.append(Verified(seq, tokens, lps, given.get(seq_id, 0), drafts))
    return out
