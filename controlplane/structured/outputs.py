"""Structured outputs in the engine: a constrained request's grammar is compiled (off the
loop, ``compiler``) before its sequences reach the scheduler, each sequence gets its own
matcher, the matcher consumes every token folded into its sequence, and each step carries
the packed bitmasks of its constrained rows that sample (``StepMasks``; on the wire each distinct
mask once, ``shared_masks``).

Overlapped scheduling: step N+1 is sent before step N's tokens are known, and a constrained
row's bitmask for N+1 depends on its token of step N. Such a step goes out with
``bitmask_follows``: the worker launches its forward pass at once and samples it when the
bitmasks arrive, which the engine sends right after folding step N (``InFlightSteps``), so
the forward pass hides the round trip. Rows whose tokens are all known (a first token, a step
with nothing else in flight) get theirs inline. While any constrained sequence runs, two steps
at most are in flight. With no constrained sequence alive nothing here runs per step.

Speculative decoding (n-gram): a constrained decode given draft positions gets the drafts the
worker's rule would propose, computed here (``headrace.common.ngram``), each checked against the
grammar: they stop at the first token the grammar rejects, the step carries a bitmask per
verified position (the matcher advanced through the drafts, then rolled back) and the worker
verifies exactly those drafts, so every token it emits is one the grammar allows, sampled from
the masked distribution. Draft models' drafts are unknown before the step: constrained
sequences do not speculate with them.

EOS is allowed by the bitmask only where the grammar accepts the output, and a complete
grammar allows nothing else: the sequence ends with its EOS (FINISH_REASON_STOP; with
``ignore_eos`` the engine stops it there too).
Preemption keeps the matcher (it has consumed exactly the sequence's tokens); a sequence
whose grammar rejects a token (it cannot happen with a correct mask) is finished with STOP
and logged. A sequence that resumes on another engine core (data parallelism,
``Submit.resumed``) gets a new matcher there, which consumes the tokens it brings before its
first mask."""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np

from headrace.common.ngram import ngram_propose
from headrace.controlplane.requests.request import Failure, Request, Sequence, Status
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.controlplane.structured import backends, shared_masks
from headrace.controlplane.structured.compiler import GrammarCompiler
from headrace.controlplane.structured.spec import ConstraintError
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.structured")


class StepMasks:
    """The constrained sequences that sample in one step, and their bitmasks; in a speculating
    step also their n-gram drafts (seq id -> tokens), cut where the grammar rejects one."""

    __slots__ = ("seqs", "ready", "step", "drafts", "_outputs")

    def __init__(self, outputs: "StructuredOutputs", step: ScheduledStep, seqs: list[Sequence]):
        self._outputs, self.step, self.seqs = outputs, step, seqs
        # every token the masks depend on is known (none of theirs is in flight)
        self.ready = not any(s.num_inflight for s in seqs)
        self.drafts: dict[int, list[int]] = {}

    def build(self) -> wpb.TokenBitmask:
        out = wpb.TokenBitmask()
        self.fill(out)
        return out

    def fill(self, field: wpb.TokenBitmask) -> None:
        """Writes the bitmasks into ``field`` (a message's own: no copy of a built one)."""
        self._outputs.bitmask(self.seqs, self.drafts, field)

    def apply(self, msg: wpb.StepRequest) -> None:
        """Puts the bitmasks (and the checked drafts) into the step's message."""
        self.fill(msg.bitmask)
        for seq_id, drafts in self.drafts.items():
            msg.checked_draft_seq_ids.append(seq_id)
            msg.checked_draft_counts.append(len(drafts))
            msg.checked_drafts.extend(drafts)


class StructuredOutputs:
    def __init__(self, backend: str = "auto"):
        self.compiler = GrammarCompiler(backend)
        self.words = 0    # int32 words per bitmask row (the model's vocabulary / 32)
        self.live = 0     # sequences with a matcher: steps carry bitmasks only while > 0
        self.eos: frozenset[int] = frozenset()
        self.num_rejected = 0
        self._rows = np.empty((0, 0), dtype="<i4")   # reused: no fresh pages for each step's masks

    def configure(self, model_dir: str | None, vocab_size: int, eos_token_ids) -> None:
        """The model served (engine start, reload)."""
        self.words = backends.bitmask_words(vocab_size)
        self.eos = frozenset(eos_token_ids)
        if model_dir is not None:
            self.compiler.configure(model_dir, vocab_size, eos_token_ids)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Request, engine) -> None:
        """Compiles ``request.structured``; the engine admits the request once its sequences
        have their matchers (now, when the grammar is cached), or it fails INVALID_ARGUMENT
        when the grammar does not compile. Meanwhile its sequences wait outside the scheduler
        (``Status.GRAMMAR``)."""
        for seq in request.sequences:
            seq.status = Status.GRAMMAR
        future = self.compiler.compile(request.structured)
        if future.done():
            self._compiled(request, future, engine)
            return

        def done(wrapped: asyncio.Future) -> None:
            if not wrapped.cancelled():
                wrapped.exception()   # (retrieved: ``_compiled`` reads it from ``future``)
            self._compiled(request, future, engine)

        asyncio.wrap_future(future).add_done_callback(done)

    def _compiled(self, request: Request, future, engine) -> None:
        if any(s.status is not Status.GRAMMAR for s in request.sequences):
            return   # aborted (client gone, drain) while it compiled
        exc = future.exception()
        if exc is None:
            compiled = future.result()
            for seq in request.sequences:
                seq.grammar = compiled.matcher()
                self._replay(seq)
            self.live += len(request.sequences)
            engine.admit(request)
            return
        if isinstance(exc, (ConstraintError, backends.BackendUnavailable)):
            failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        else:
            log.error("compiling a grammar failed: %r", exc)
            failure = Failure(grpc.StatusCode.INTERNAL, f"structured: compiling failed: {exc!r}")
        for seq in request.sequences:   # never scheduled: it ends here
            seq.status, seq.finish_reason = Status.FINISHED, pb.FINISH_REASON_ABORTED
        if engine.requests.pop(request.request_id, None) is not None:
            engine.telemetry.request_done(request)
        request.fail(failure)

    def _replay(self, seq: Sequence) -> None:
        """A sequence that arrives with output tokens (it resumes here after its engine core was
        lost, ``Submit.resumed``): its new matcher consumes them first, so its masks go on
        from where the lost core's left off."""
        for token in seq.output_token_ids:
            if not seq.grammar.accept(token):
                self.num_rejected += 1
                log.warning("sequence %d: its grammar rejected resumed token %d", seq.seq_id, token)
                return

    def release(self, seq: Sequence) -> None:
        """The sequence finished: its matcher goes."""
        if seq.grammar is not None:
            seq.grammar = None
            self.live -= 1

    # -- tokens -----------------------------------------------------------------------------
    def after_token(self, seq: Sequence, reason: int) -> int:
        """``seq`` got a token (its last output): the matcher consumes it. Returns the finish
        reason: ``reason`` if set, else STOP when it was the grammar's final EOS (sampled under
        ``ignore_eos``) or the grammar rejected it (its text is then not returned)."""
        if reason != pb.FINISH_REASON_UNSPECIFIED:
            return reason
        matcher, token = seq.grammar, seq.output_token_ids[-1]
        if not matcher.accept(token):
            self.num_rejected += 1
            log.warning("sequence %d: its grammar rejected token %d; finishing it", seq.seq_id, token)
            return pb.FINISH_REASON_STOP
        return pb.FINISH_REASON_STOP if token in self.eos and matcher.finished else reason

    # -- steps ------------------------------------------------------------------------------
    def step_masks(self, step: ScheduledStep, speculation=None) -> StepMasks | None:
        """The bitmasks ``step`` needs (None: no constrained row samples in it). Call after
        ``schedule`` and before ``after_step`` (a row samples when it computes its last token).
        In a speculating step (n-gram, ``speculation``), a constrained decode given positions
        gets the drafts the worker's rule proposes (``headrace.common.ngram``), to be checked."""
        seqs = [seq for seq, n in step.scheduled()
                if seq.grammar is not None and seq.num_computed + n == seq.num_total]
        if not seqs:
            return None
        masks = StepMasks(self, step, seqs)
        if step.speculative and speculation is not None:
            cfg = speculation.config
            given = dict(zip((s.seq_id for s in step.running.seqs), step.running.num_spec))
            for seq in seqs:
                if given.get(seq.seq_id):
                    masks.drafts[seq.seq_id] = ngram_propose(
                        np.asarray(seq.token_ids), given[seq.seq_id], cfg.prompt_lookup_min,
                        cfg.prompt_lookup_max).tolist()
        return masks

    def rows(self, n: int) -> np.ndarray:
        """``n`` bitmask rows to fill, in memory reused from step to step."""
        if self._rows.shape[0] < n or self._rows.shape[1] != self.words:
            self._rows = np.empty((max(n, 2 * self._rows.shape[0]), self.words), dtype="<i4")
        return self._rows[:n]

    def bitmask(self, seqs: list[Sequence], drafts: dict[int, list[int]] | None = None,
                out: wpb.TokenBitmask | None = None) -> wpb.TokenBitmask:
        """The packed bitmask of each sequence's next token (all ones for one that finished
        meanwhile: its token is dropped anyway); for a sequence with ``drafts``, also the
        bitmask after each draft, cut (in ``drafts`` too) at the first the grammar rejects.
        Written into ``out`` when given (a message's field), else into a new message."""
        out = wpb.TokenBitmask() if out is None else out
        rows = self.rows(len(seqs))
        live = [(i, s.grammar) for i, s in enumerate(seqs)
                if s.grammar is not None and s.status is not Status.FINISHED]
        if len(live) < len(seqs):
            rows.fill(-1)
        if live:
            self.compiler.backend.fill_rows([m for _, m in live], rows, [i for i, _ in live])
        if not drafts:
            out.seq_ids.extend(s.seq_id for s in seqs)
            shared_masks.pack(rows, out)
            return out
        ids, parts = [], []
        for i, seq in enumerate(seqs):
            extra = self._draft_rows(seq.grammar, rows[i], drafts.get(seq.seq_id) or [])
            if seq.seq_id in drafts:
                drafts[seq.seq_id] = drafts[seq.seq_id][:len(extra)]
            ids += [seq.seq_id] * (1 + len(extra))
            parts += [rows[i:i + 1]] + extra
        out.seq_ids.extend(ids)
        shared_masks.pack(np.concatenate(parts), out)
        return out

    def _draft_rows(self, matcher, row: np.ndarray, drafts: list[int]) -> list[np.ndarray]:
        """The bitmask after each draft, as long as each is allowed by the one before (the
        first draft the grammar rejects ends them); the matcher is rolled back after."""
        out = []
        for t in drafts:
            if matcher is None or not (int(row[t >> 5]) >> (t & 31)) & 1 or not matcher.accept(t):
                break
            row = np.empty((1, self.words), dtype="<i4")
            matcher.fill(row[0])
            out.append(row)
            row = row[0]
        if out:
            matcher.rollback(len(out))
        return out
