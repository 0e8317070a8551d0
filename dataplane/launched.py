"""The records of a step between ``ModelRunner.launch`` and ``finish``: what a launched
step's device work will produce and what its result needs, a step prepared ahead of its
launch, and a new sequence's sampling parameters as the worker keeps them."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from headrace.dataplane.sampler import SampleOutput, SamplingRow
from headrace.dataplane.spec_decode import Verified
from headrace.worker.v1 import worker_pb2 as pb


def sampling_row(seq: pb.NewSequence) -> SamplingRow:
    """The sequence's sampling parameters as sent (the control plane filled the defaults)."""
    s = seq.sampling
    return SamplingRow(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed if s.has_seed else None,
        logprobs=s.logprobs, min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids),
        prompt_token_ids=list(seq.prompt_token_ids), output_token_ids=list(seq.output_token_ids),
        bias_ids=list(s.logit_bias.keys()), bias_values=list(s.logit_bias.values()))


@dataclasses.dataclass
class Launched:
    """A step whose device work is enqueued; ``finish`` turns it into its StepResult."""

    step_id: int
    started: float
    seq_ids: list[int] = dataclasses.field(default_factory=list)
    out: SampleOutput | None = None
    histories: list[tuple[int, SamplingRow]] = dataclasses.field(default_factory=list)
    stop_watch: tuple = ()   # see InputBatch.stop_watch
    begin: torch.cuda.Event | None = None      # device timeline: the step's first op ...
    done: torch.cuda.Event | None = None       # ... and its last (the ids are on the host)
    previous: torch.cuda.Event | None = None   # the last op of the step launched before
    sample_begin: torch.cuda.Event | None = None   # sampling's first op (GPU)
    sample_ms: float = 0.0                         # sampling's host time (CPU)
    verified: Verified | None = None               # a speculative verify (spec_decode)
    token_rows: np.ndarray | None = None           # the rows that sampled, and where their
    token_pos: np.ndarray | None = None            # tokens go in the token mirror
    kind: str = ""      # decode, mixed, prefill or verify (``forward.step_kind``)
    graph: str = ""     # how its forward ran: full, piecewise or eager (``forward.MODES``)
    # host time of launch's phases (ms): apply (the delta), build (inputs, packed for their
    # upload), forward (the upload's and the forward's launches; on a CPU the forward itself),
    # sample (sampling's launches)
    host_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    awaiting: tuple | None = None   # launched with bitmask_follows: (logits, sampling, device
                                    # arrays, prepared batch, their host arrays) until
                                    # ``sample_late``; () when none of its rows samples (they
                                    # stopped the step before)
    logits_ready: torch.cuda.Event | None = None   # ... and its forward pass's end (GPU)

    def forward_done(self) -> bool:
        """Whether the forward pass has run (always on a CPU, where launching runs it)."""
        return self.logits_ready is None or self.logits_ready.query()


@dataclasses.dataclass
class Prepared:
    """A step's host half (``ModelRunner.prepare_ahead``): its delta applied, its inputs built
    and packed into a pinned buffer; launching it queues the device work alone."""

    step: pb.StepRequest
    launched: Launched
    delta: object                  # step_delta.StepRows
    prep: object = None            # input_batch.PreparedBatch; None: no row left to run
    sampling: object = None        # sampler.SamplingBatch; None: nothing samples
    packed: object = None          # staging.Packed: the inputs, their transfer not queued
