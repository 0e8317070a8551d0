"""The worker's persistent mirror of the sequences it holds, one row each, in numpy arrays.

Step deltas update rows in place (O(changes)); ``prepare`` turns the rows scheduled in a
step into the flat model inputs with vectorized numpy, so a decode step costs no Python work
per token. Only prefill chunks copy token slices row by row. Sampling parameters live in
per-row arrays too; a row keeps its token history only when a penalty needs it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from headrace.dataplane.sampler import SamplingBatch, SamplingRow, signed_seed


class BatchError(ValueError):
    """A step delta that contradicts the mirror."""


@dataclasses.dataclass
class PreparedBatch:
    input_ids: np.ndarray        # [tokens] int64
    positions: np.ndarray        # [tokens] int64
    slot_mapping: np.ndarray     # [tokens] int64
    query_start_loc: np.ndarray  # [seqs + 1] int32
    seq_lens: np.ndarray         # [seqs] int32
    block_tables: np.ndarray     # [seqs, width] int32
    logits_indices: np.ndarray   # [sampling seqs] int64: the token whose logits are sampled
    sample_rows: np.ndarray      # [sampling seqs] rows that sample, in step order
    max_query_len: int
    decode_only: bool
    last_index: np.ndarray       # positions in input_ids that read a row's last token ...
    last_rows: np.ndarray        # ... from these rows (the device keeps them: maybe just sampled)
    num_decodes: int = 0         # mixed batches: the first num_decodes rows compute one token
    decode_order: np.ndarray | None = None   # [decode rows] int32: longest context first
    num_drafts: np.ndarray | None = None     # [sampling seqs] speculative drafts each verifies:
                                             # its logits_indices are its last 1 + drafts tokens
    lora_slots: np.ndarray | None = None     # [tokens] int64 adapter slot of each token (-1:
                                             # none); None when no held sequence has an adapter
    lora: object = None                      # its headrace.dataplane.lora.batch.Plan (set by the forward)


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """Row indices by context length, longest first (the decode attention's start order)."""
    return np.argsort(-seq_lens, kind="stable").astype(np.int32)


class InputBatch:
    def __init__(self, max_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
                 keep_tokens: bool = False):
        self.max_seqs, self.block_size, self.num_blocks = max_seqs, block_size, num_blocks
        self.max_blocks = -(-max_model_len // block_size)
        self.block_table = np.zeros((max_seqs, self.max_blocks), dtype=np.int32)
        self.num_table = np.zeros(max_seqs, dtype=np.int64)
        self.num_computed = np.zeros(max_seqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_seqs, dtype=np.int64)
        self.num_output = np.zeros(max_seqs, dtype=np.int64)
        self.temperature = np.zeros(max_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_seqs, dtype=np.int64)
        self.top_p = np.ones(max_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_seqs, dtype=np.float32)
        self.seed = np.zeros(max_seqs, dtype=np.int64)
        self.has_seed = np.zeros(max_seqs, dtype=bool)
        self.logprobs = np.zeros(max_seqs, dtype=np.int64)
        self.uses_history = np.zeros(max_seqs, dtype=bool)
        self.num_history_rows = 0   # rows that keep a token history (penalties)
        self.min_tokens = np.zeros(max_seqs, dtype=np.int64)
        self.has_stops = np.zeros(max_seqs, dtype=bool)
        self.stop_ids: list[frozenset[int] | None] = [None] * max_seqs
        self.stop_table = np.full((max_seqs, 1), -1, dtype=np.int64)   # the same, -1 padded
        self.stopped: set[int] = set()   # seq ids whose sampled token finished them
        self.lora_slot = np.full(max_seqs, -1, dtype=np.int64)   # adapter slot (-1: none)
        self.num_lora_rows = 0   # rows whose sequence uses an adapter
        self.rows: dict[int, int] = {}
        self.version = 0   # bumped when a sequence is added or removed (``step_delta``'s index)
        self.sampling: list[SamplingRow | None] = [None] * max_seqs
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        # every row's known tokens, when speculation proposes from them (``record``)
        self.tokens = np.zeros((max_seqs, max_model_len), np.int32) if keep_tokens else None

    def clear(self) -> None:
        for seq_id in list(self.rows):
            self.remove(seq_id)

    def remove(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        self.stopped.discard(seq_id)
        if row is not None:
            self.version += 1
            self.sampling[row] = None
            self.stop_ids[row], self.has_stops[row] = None, False
            self.num_history_rows -= int(self.uses_history[row])
            self.uses_history[row] = False
            self.num_lora_rows -= int(self.lora_slot[row] >= 0)
            self.lora_slot[row] = -1
            self._free_rows.append(row)

    def _set_blocks(self, row: int, start: int, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        end = start + len(ids)
        if end > self.max_blocks:
            raise BatchError("block table longer than max_model_len allows")
        if len(ids) and (ids.max() >= self.num_blocks or ids.min() < 0):
            raise BatchError("block id out of range")
        self.block_table[row, start:end] = ids
        self.num_table[row] = end

    def add(self, seq_id: int, row_state: SamplingRow, block_ids, num_computed: int,
            lora_slot: int = -1) -> int:
        if seq_id in self.rows:
            raise BatchError(f"sequence {seq_id} is already running")
        if not self._free_rows:
            raise BatchError(f"more than {self.max_seqs} sequences held")
        row = self._free_rows.pop()
        self.rows[seq_id] = row
        self.version += 1
        self.sampling[row] = row_state
        n = len(row_state.prompt_token_ids) + len(row_state.output_token_ids)
        if n == 0:
            raise BatchError(f"sequence {seq_id} has no tokens")
        self.num_tokens[row], self.num_computed[row] = n, num_computed
        r = row_state
        self.num_output[row] = len(r.output_token_ids)
        self.temperature[row], self.top_k[row], self.top_p[row] = r.temperature, r.top_k, r.top_p
        self.min_p[row], self.logprobs[row] = r.min_p, r.logprobs
        self.has_seed[row] = r.seed is not None
        self.seed[row] = signed_seed(r.seed or 0)
        self.uses_history[row] = r.uses_history
        self.num_history_rows += int(r.uses_history)
        self.min_tokens[row] = r.min_tokens
        self.stop_ids[row] = frozenset(r.stop_token_ids) or None
        self.has_stops[row] = self.stop_ids[row] is not None
        self._set_stops(row, sorted(self.stop_ids[row] or ()))
        self._set_blocks(row, 0, block_ids)
        self.lora_slot[row] = lora_slot
        self.num_lora_rows += int(lora_slot >= 0)
        if self.tokens is not None:
            self.tokens[row, :n] = r.prompt_token_ids + r.output_token_ids
        return row

    def _set_stops(self, row: int, ids: list[int]) -> None:
        if len(ids) > self.stop_table.shape[1]:   # a wider table (rarely: ids are few)
            wider = np.full((self.max_seqs, len(ids)), -1, dtype=np.int64)
            wider[:, :self.stop_table.shape[1]] = self.stop_table
            self.stop_table = wider
        self.stop_table[row] = -1
        self.stop_table[row, :len(ids)] = ids

    def truncate(self, seq_ids, num_blocks) -> None:
        """Cuts block tables back (the control plane took back speculative blocks); sequences
        no longer held are skipped (they were forgotten before this step)."""
        for seq_id, n in zip(seq_ids, num_blocks):
            row = self.rows.get(seq_id)
            if row is not None:
                self.num_table[row] = min(int(self.num_table[row]), n)

    def record(self, rows: np.ndarray, positions: np.ndarray, tokens) -> None:
        """Writes sampled tokens into the token mirror (kept only for speculation)."""
        if self.tokens is not None and len(rows):
            self.tokens[rows, positions] = tokens

    def row_of(self, seq_id: int) -> int:
        row = self.rows.get(seq_id)
        if row is None:
            raise BatchError(f"unknown sequence {seq_id}")
        return row

    def rows_of(self, seq_ids) -> list[int]:
        try:
            return [self.rows[s] for s in seq_ids]
        except KeyError as exc:
            raise BatchError(f"unknown sequence {exc.args[0]}") from None

    def append_blocks(self, rows: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> None:
        """Row ``rows[i]`` gets the next ``counts[i]`` block ids of ``ids`` (all [n] int64)."""
        if len(ids) == 0:
            return
        if ids.max() >= self.num_blocks or ids.min() < 0:
            raise BatchError("block id out of range")
        starts = self.num_table[rows]
        if (starts + counts > self.max_blocks).any():
            raise BatchError("block table longer than max_model_len allows")
        first = np.cumsum(counts) - counts   # where each row's ids start in ``ids``
        cols = np.arange(len(ids)) - np.repeat(first - starts, counts)
        self.block_table[np.repeat(rows, counts), cols] = ids
        self.num_table[rows] = starts + counts

    def count_sampled(self, rows: np.ndarray) -> list[SamplingRow]:
        """The rows sampled one more token (its value may still be on the device); returns
        the rows that keep a history, to be given the value with ``SamplingRow`` later."""
        self.num_tokens[rows] += 1
        self.num_output[rows] += 1
        keep = self.uses_history[rows]
        return [self.sampling[int(r)] for r in rows[keep]] if keep.any() else []

    # The stop rule (worker.proto, Sampling): a sampled token finishes its sequence when it is
    # one of the sequence's stop ids and at least min_tokens outputs, that token included, are
    # out. It is evaluated here only, in two halves: ``stop_watch`` picks the rows that may
    # stop when a step is launched, ``mark_stopped`` checks their tokens once they are known;
    # the StepResult reports the verdict and the control plane follows it.

    def stop_watch(self, rows: np.ndarray, seq_ids: np.ndarray) -> tuple:
        """For rows that just counted a sample (``count_sampled``) and may stop on it: their
        indices in ``rows``, seq ids and stop ids (a copy of their table rows: the rows may be
        reused before the tokens are known), for ``mark_stopped``. Array work only."""
        watch = np.flatnonzero(self.has_stops[rows] & (self.num_output[rows] >= self.min_tokens[rows]))
        return watch, seq_ids[watch], self.stop_table[rows[watch]]

    def mark_stopped(self, watch: tuple, tokens: list[int]) -> list[int]:
        """The watched sequences whose sampled token finishes them; those still held are left
        out of the steps that run next (``stopped``)."""
        if not watch or not len(watch[0]):
            return []
        index, seq_ids, table = watch
        sampled = np.asarray(tokens, dtype=np.int64)[index]
        done = seq_ids[(table == sampled[:, None]).any(axis=1)].tolist()
        self.stopped.update(s for s in done if s in self.rows)
        return done

    def history_mask(self, rows: np.ndarray) -> np.ndarray:
        return self.uses_history[rows]

    def sampling_batch(self, rows: np.ndarray) -> SamplingBatch:
        keep = self.uses_history[rows]
        return SamplingBatch(
            self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
            self.seed[rows], self.has_seed[rows], self.num_output[rows], self.logprobs[rows],
            [(int(i), self.sampling[int(rows[i])]) for i in np.flatnonzero(keep)])

    def prepare(self, rows: np.ndarray, num_scheduled: np.ndarray,
                drafts: np.ndarray | None = None) -> PreparedBatch:
        """Flat inputs for the rows scheduled in a step (validated against the mirror).
        ``drafts``: speculative tokens per row, already in ``tokens`` and counted as known
        (``headrace.dataplane.spec_decode``); a row's logits are then taken at its last 1 + drafts."""
        computed = self.num_computed[rows]
        ends = computed + num_scheduled
        known = self.num_tokens[rows]
        if (num_scheduled < 1).any() or (ends > known).any():
            raise BatchError("tokens scheduled beyond a sequence's known tokens")
        if (ends > self.num_table[rows] * self.block_size).any():
            raise BatchError("block table too short for the scheduled tokens")
        bs = self.block_size
        width = int(self.num_table[rows].max())
        self.num_computed[rows] = ends
        sampling = ends == known
        if int(num_scheduled.max()) == 1 and sampling.all():   # decode only: one token per row
            n = len(rows)
            slots = self.block_table[rows, computed // bs].astype(np.int64) * bs + computed % bs
            index = np.arange(n, dtype=np.int64)
            return PreparedBatch(
                input_ids=np.zeros(0, dtype=np.int64), positions=computed, slot_mapping=slots,
                query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=ends.astype(np.int32),
                block_tables=self.block_table[rows, :width], logits_indices=index, sample_rows=rows,
                max_query_len=1, decode_only=True, last_index=index, last_rows=rows,
                decode_order=longest_first(ends),
                lora_slots=self.lora_slot[rows] if self.num_lora_rows else None)
        # A mixed batch puts its one-token rows first: attention runs them with the decode
        # kernel and only the rest with prefill tiles.
        single = num_scheduled == 1
        num_decodes = int(single.sum())
        if 0 < num_decodes < len(rows) and not single[:num_decodes].all():
            order = np.argsort(~single, kind="stable")
            rows, num_scheduled, computed, ends = (rows[order], num_scheduled[order],
                                                   computed[order], ends[order])
            sampling = sampling[order]
            drafts = None if drafts is None else drafts[order]
        total = int(num_scheduled.sum())
        starts = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=starts[1:])
        row_of_token = np.repeat(rows, num_scheduled)
        positions = np.arange(total, dtype=np.int64) + np.repeat(computed - starts[:-1], num_scheduled)
        at_end = (num_scheduled == 1) & sampling
        # decodes read their last token from the device (it may have just been sampled there);
        # prefill chunks read tokens the control plane sent
        input_ids = np.zeros(total, dtype=np.int64)
        for i in np.flatnonzero(~at_end).tolist():
            s = self.sampling[int(rows[i])]
            prompt = s.prompt_token_ids
            lo, hi = int(computed[i]), int(ends[i])
            if drafts is not None and drafts[i]:   # a verify: its tokens are in the mirror only
                chunk = self.tokens[int(rows[i]), lo:hi]
            else:
                chunk = prompt[lo:hi] if hi <= len(prompt) else (prompt + s.output_token_ids)[lo:hi]
            input_ids[starts[i]:starts[i + 1]] = chunk
        slots = self.block_table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        logits_indices, num_drafts = (starts[1:] - 1)[sampling].astype(np.int64), None
        if drafts is not None:   # a verifying row's logits: its last 1 + drafts tokens
            num_drafts = drafts[sampling].astype(np.int64)
            first = np.repeat(logits_indices - num_drafts, num_drafts + 1)
            group = np.repeat(np.cumsum(num_drafts + 1) - (num_drafts + 1), num_drafts + 1)
            logits_indices = first + np.arange(len(first)) - group
        return PreparedBatch(
            input_ids=input_ids, positions=positions, slot_mapping=slots, query_start_loc=starts,
            seq_lens=ends.astype(np.int32), block_tables=self.block_table[rows, :width],
            logits_indices=logits_indices, sample_rows=rows[sampling],
            max_query_len=int(num_scheduled.max()), decode_only=False,
            last_index=starts[:-1][at_end].astype(np.int64), last_rows=rows[at_end],
            num_decodes=num_decodes, decode_order=longest_first(ends[:num_decodes]),
            num_drafts=num_drafts,
            lora_slots=self.lora_slot[row_of_token] if self.num_lora_rows else None)
