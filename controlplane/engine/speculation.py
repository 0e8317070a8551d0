"""Speculative decoding as the control plane runs it: which running decodes speculate in a
step and how many positions each gets, the back-off, and the counters behind the
``spec_decode_*`` metrics. The worker proposes and verifies (``WorkerInfo.speculative`` says
how it is configured); the scheduler budgets the positions and their blocks from here.

Back-off: no sequence speculates while more than ``disable_by_batch_size`` decodes run (the
step is then a throughput step and keeps its pipeline of steps in flight). Each sequence
keeps an EWMA of its acceptance (accepted drafts / positions given); below
``min_acceptance`` it stops speculating for ``PROBE_TOKENS`` decodes, then probes once;
each failed probe doubles the pause (up to ``MAX_PAUSE``), a good one resets it.

No proposal, no speculation: for ``ngram`` a decode gets positions only when the worker's
lookup will find a match (``proposes``: its last ``prompt_lookup_min`` tokens occur earlier,
followed by a token; every longer match contains one), checked against an index of the
sequence's n-grams that grows with its tokens. ``active`` asks the same of the tokens known
while others are in flight (a prediction; the engine then lets the pipeline drain and the
step is scheduled with every token known), so a batch in which nothing would be proposed
keeps its pipeline of steps in flight and costs the worker nothing.
"""

from __future__ import annotations

from typing import Callable

from headrace.common.speculative import SpeculativeConfig
from headrace.controlplane.engine import step_codec
from headrace.controlplane.requests.request import Sequence
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

EWMA_WEIGHT = 0.3     # weight of the newest observation
PROBE_TOKENS = 16     # decodes without speculation after a back-off (doubling per failed probe)
MAX_PAUSE = 256


def uses_history(seq: Sequence) -> bool:
    """Penalties (and min_tokens with stop ids) need the token history, and a logit bias is
    applied row by row too: the worker does not speculate for such sequences (its sampler
    applies them per row, not per position)."""
    s = seq.sampling
    return (s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
            or (bool(s.stop_token_ids) and s.min_tokens > 0) or bool(s.logit_bias))


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self._state: dict[int, list] = {}   # seq id -> [acceptance EWMA, decodes paused, pause]
        self._grams: dict[int, list] = {}   # seq id -> [n-grams followed by a token, how many]
        self.num_drafts = 0                 # verify steps of a sequence with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def active(self, running: list[Sequence]) -> bool:
        """Whether the next step may speculate: few enough decodes run and one of them is
        not paused (then the engine runs that step alone, with nothing else in flight)."""
        if len(running) > self.config.disable_by_batch_size:
            return False
        state = self._state
        return any(not s.in_prefill and (s.seq_id not in state or not state[s.seq_id][1])
                   and self._eligible(s) and self._left(s) > 0 and self.proposes(s) for s in running)

    def _eligible(self, seq: Sequence) -> bool:
        """No penalties; a structured-output sequence only with n-gram drafts, which the control
        plane proposes too and checks against its grammar (``headrace.controlplane.structured``): a
        draft model's drafts are not known before the step."""
        return not uses_history(seq) and (getattr(seq, "grammar", None) is None
                                          or self.config.method == "ngram")

    def proposes(self, seq: Sequence) -> bool:
        """Whether the worker's proposer finds drafts for ``seq``'s known tokens (always for a
        draft model; for ``ngram``: its last ``prompt_lookup_min`` tokens occur earlier)."""
        if self.config.method != "ngram":
            return True
        lo, prompt, out = self.config.prompt_lookup_min, seq.prompt_token_ids, seq.output_token_ids
        n = len(prompt) + len(out)
        if n <= lo:
            return False
        entry = self._grams.get(seq.seq_id)
        if entry is None:
            entry = self._grams[seq.seq_id] = [set(), 0]
        grams, done = entry
        if done < n - lo:   # the windows starting at done .. n - lo - 1 are followed by a token
            tokens, base = (out, len(prompt)) if done >= len(prompt) else (prompt + out, 0)
            grams.update(tuple(tokens[i - base:i - base + lo]) for i in range(done, n - lo))
            entry[1] = n - lo
        last = out[-lo:] if len(out) >= lo else (prompt + out)[-lo:]
        return tuple(last) in grams

    @staticmethod
    def _left(seq: Sequence) -> int:
        """Tokens ``seq`` may still get beyond the next one."""
        return seq.max_tokens - len(seq.output_token_ids) - seq.num_inflight - 1

    def positions(self, seq: Sequence, budget: int) -> int:
        """Speculative positions for a decode of ``seq`` in a speculating step (0: none); a
        paused sequence counts one decode of its pause."""
        state = self._state.get(seq.seq_id)
        if state is None:
            state = self._state[seq.seq_id] = [1.0, 0, PROBE_TOKENS]
        if state[1]:
            state[1] -= 1
            return 0
        if not self._eligible(seq) or not self.proposes(seq):
            return 0
        return max(0, min(self.k, self._left(seq), self.max_model_len - seq.num_total, budget - 1))

    def grant(self, seq: Sequence, blocks, budget: int, speculating: bool) -> tuple[int, list[int]]:
        """A decode of ``seq`` (its next token scheduled, ``budget`` tokens left before it):
        its speculative positions in this step and the blocks grown for them, only from free
        ones (speculation never preempts). Outside a speculating step it ticks its pause."""
        if not speculating:
            self.pause_tick(seq)
            return 0, []
        end = seq.num_computed + 1
        k = min(self.positions(seq, budget), blocks.max_tokens_growable(seq.seq_id) - end)
        if k > 0 and blocks.needs_blocks(seq.seq_id, end + k):
            return k, blocks.grow(seq.seq_id, end + k)
        return k, []

    def pause_tick(self, seq: Sequence) -> None:
        """A decode of ``seq`` in a step that does not speculate counts towards its pause."""
        state = self._state.get(seq.seq_id)
        if state is not None and state[1]:
            state[1] -= 1

    def observe(self, seq: Sequence, given: int, drafts: int, accepted: int) -> None:
        """A verified step of ``seq``: ``given`` positions, ``drafts`` proposed, ``accepted``."""
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_pos[j] += 1
        state = self._state.get(seq.seq_id)
        if state is None or not given:   # finished or forgotten meanwhile, or not speculating
            return
        rate = accepted / given if given else 0.0
        state[0] = (1 - EWMA_WEIGHT) * state[0] + EWMA_WEIGHT * rate
        floor = self.config.min_acceptance
        if state[0] < floor:   # back off; the probe after the pause starts at the floor
            state[0], state[1], state[2] = floor, state[2], min(MAX_PAUSE, 2 * state[2])
        elif rate >= floor:
            state[2] = PROBE_TOKENS

    def forget(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
        self._grams.pop(seq_id, None)


def fold_verified(step: ScheduledStep, result: wpb.StepResult, stopped: set[int],
                  check: Callable[[Sequence, bool], int],
                  first_token: Callable[[Sequence], None], settle: Callable[[Sequence, int], None],
                  verified: Callable[[Sequence, int, int, int], None]) -> int:
    """The engine's fold of a speculating step's result: each sequence's tokens are appended
    one by one, ``check`` (the engine's stop rules and grammar) run after each (what follows a
    stop is dropped); then ``settle`` finishes or wakes it and ``verified`` (the scheduler's)
    fixes its KV, blocks and back-off. ``stopped``: sequences whose last token the worker's
    stop-token rule ended. Returns how many tokens reached their sequences."""
    emitted = 0
    for v in step_codec.decode_verified(step, result):
        seq, last = v.seq, len(v.tokens) - 1
        reason = pb.FINISH_REASON_UNSPECIFIED
        for j, token in enumerate(v.tokens):
            seq.output_token_ids.append(token)
            if v.logprobs:
                seq.logprobs.append(v.logprobs[j])
            emitted += 1
            if len(seq.output_token_ids) == 1:
                first_token(seq)
            reason = check(seq, j == last and seq.seq_id in stopped)
            if reason != pb.FINISH_REASON_UNSPECIFIED:
                break
        settle(seq, reason)
        verified(seq, v.given, v.drafts, last)   # after its tokens are in (or it is released)
    return emitted
