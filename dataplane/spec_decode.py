"""Speculative decoding in the data plane: proposing drafts from the token mirror (n-gram /
prompt lookup), verifying them in the step's one target forward pass, and turning the
verdict into the step's result and the mirror's new state.

The control plane gives a running decode ``k`` speculative positions (``running_num_spec``,
block table grown to cover them). ``propose`` looks the row's last ``prompt_lookup_max`` ..
``prompt_lookup_min`` tokens up in its earlier tokens and drafts up to ``k`` of the tokens
that followed the first match; the row then computes its next token and the drafts in one
pass (a short prefill over the paged cache) and gets logits at all 1 + d positions.

Acceptance is rejection sampling with a point-mass draft (Leviathan et al. with q = onehot):
draft x is accepted with probability p(x) and, on rejection, the token is drawn from p with
x removed and renormalised. The sampler draws ``y_j ~ p_j`` at every position with
independent noise; accepting while ``y_j == x_j`` and emitting ``y`` at the first mismatch is
exactly that rule (P(y = x) = p(x); y given y != x follows norm(p - p(x) onehot(x))), and a
bonus token ``y_d`` comes when all d are accepted. Greedy rows therefore accept on exact
match. ``verify`` runs on the device; each position samples with the noise counter of the
output index it would have without speculation, so seeded sampling is reproducible too.

On a GPU a verify in which every sequence samples (decodes only, no prefill chunk) runs as decode
rows in the decode CUDA graphs (``decode_rows``; ``headrace.dataplane.cuda_graphs``); the ladder is
sized for ``graph_rows`` rows. Acceptance runs on the device after the replay, no sync.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from headrace.common.ngram import ngram_propose  # noqa: F401 (the proposer; the control plane uses it too)
from headrace.common.speculative import SpeculativeConfig
from headrace.dataplane.input_batch import InputBatch, PreparedBatch, longest_first
from headrace.dataplane.sampler import SamplingBatch


def graph_rows(config: SpeculativeConfig | None, max_num_seqs: int) -> int:
    """Rows the decode graphs need: a verify of every sequence that may speculate, each with
    1 + k tokens (the control plane speculates with at most ``disable_by_batch_size`` decodes)."""
    if config is None:
        return max_num_seqs
    k = config.num_speculative_tokens
    return max(max_num_seqs, min(max_num_seqs, config.disable_by_batch_size) * (k + 1))


def decode_rows(prep: PreparedBatch) -> dict[str, np.ndarray] | None:
    """A verify whose every sequence samples as one decode row per token: the row's context
    ends at its token (causal over the drafts), its block table is its sequence's. Returns the
    per-row seq_lens, block_tables and decode_order (positions and slots already are per
    token), or None for a step that is not such a verify (prefill chunks run eagerly)."""
    if prep.num_drafts is None or len(prep.sample_rows) != len(prep.seq_lens):
        return None
    q_lens = np.diff(prep.query_start_loc)
    if len(prep.logits_indices) != len(prep.positions):   # every token is verified
        return None
    seq_lens = (prep.positions + 1).astype(np.int32)
    return {"seq_lens": seq_lens, "block_tables": np.repeat(prep.block_tables, q_lens, axis=0),
            "decode_order": longest_first(seq_lens)}


@torch.inference_mode()
def verify(sampled: torch.Tensor, index: torch.Tensor, drafts: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """sampled: [logit rows] the target's sample at every verified position; index: [seqs,
    K + 1] each sequence's logit rows (padded with its last); drafts: [seqs, K] (padded with
    -1). Returns the drafts each sequence accepted [seqs] and its last emitted token [seqs]."""
    y = sampled[index]
    accepted = (y[:, :-1] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return accepted, y.gather(1, accepted[:, None]).squeeze(1)


@dataclasses.dataclass
class Verified:
    """What ``finish`` needs of a verifying step, recorded at launch."""
    rows: np.ndarray            # [sampling seqs] rows, in step order
    num_drafts: np.ndarray      # [sampling seqs]
    num_output: np.ndarray      # [sampling seqs] outputs before this step
    accepted: torch.Tensor      # [sampling seqs] on the host once the step is done


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft=None):
        """``draft``: the ``headrace.dataplane.draft_model.DraftModel`` proposing for
``draft_model``."""
        if config.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method {config.method!r} is not supported by this worker")
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("speculative method draft_model needs its DraftModel (and only it)")
        self.config = config
        self.draft = draft
        self._drafts: dict[int, np.ndarray] = {}   # row -> drafts of the step being launched
        self.num_unproposed = 0   # steps that gave positions and found no drafts (the control
                                  # plane predicts proposals: this stays ~0)

    def propose(self, batch: InputBatch, rows: np.ndarray, spec: np.ndarray,
                checked: dict[int, np.ndarray] | None = None) -> np.ndarray | None:
        """Drafts for the rows given speculative positions (``spec``: k per row); they go into
        the token mirror and count as known until ``unpropose``. Returns drafts per row, or None
        when no row drafted anything. Rows that keep a token history (penalties) do not draft.
        ``checked``: row -> the drafts the control plane checked against its grammar
        (structured outputs), taken as they are instead of proposing."""
        self._drafts.clear()
        cfg, counts = self.config, np.zeros(len(rows), np.int64)
        wanted = []   # (index, row, k) of the decodes that draft
        for i in np.flatnonzero(spec).tolist():
            row = int(rows[i])
            n = int(batch.num_tokens[row])
            if batch.uses_history[row] or n > batch.num_computed[row] + 1:
                continue   # penalties, or not a decode
            k = min(int(spec[i]), batch.tokens.shape[1] - n)
            if k > 0:
                wanted.append((i, row, k))
        if checked:
            given = [(w, checked[w[1]][:w[2]]) for w in wanted if w[1] in checked]
            wanted = [w for w in wanted if w[1] not in checked]
        if self.draft is not None and wanted:
            proposals = self.draft.propose(batch, [w[1] for w in wanted], [w[2] for w in wanted])
        else:
            proposals = [ngram_propose(batch.tokens[row, :int(batch.num_tokens[row])], k,
                                       cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                         for _, row, k in wanted]
        if checked:
            wanted, proposals = wanted + [w for w, _ in given], list(proposals) + [d for _, d in given]
        for (i, row, _), drafts in zip(wanted, proposals):
            n = int(batch.num_tokens[row])
            if len(drafts):
                batch.tokens[row, n:n + len(drafts)] = drafts
                counts[i] = len(drafts)
                self._drafts[row] = drafts.astype(np.int64)
        if not self._drafts:
            self.num_unproposed += 1
            return None
        batch.num_tokens[rows] += counts
        return counts

    @staticmethod
    def unpropose(batch: InputBatch, rows: np.ndarray, drafts: np.ndarray) -> None:
        """After ``prepare``: drafts are no longer counted as known tokens (until verified)."""
        batch.num_tokens[rows] -= drafts

    def sampling_batch(self, batch: InputBatch, prep: PreparedBatch) -> SamplingBatch:
        """One sampling row per verified position, each with the output index (noise counter,
        min_tokens) it would have without speculation."""
        nd = prep.num_drafts
        rows = np.repeat(prep.sample_rows, nd + 1)
        sampling = batch.sampling_batch(rows)
        sampling.num_output = sampling.num_output + np.arange(len(rows)) - np.repeat(
            np.cumsum(nd + 1) - (nd + 1), nd + 1)
        return sampling

    def verify_arrays(self, prep: PreparedBatch) -> dict[str, np.ndarray]:
        nd = prep.num_drafts
        width = int(nd.max())
        first = np.cumsum(nd + 1) - (nd + 1)
        index = first[:, None] + np.minimum(np.arange(width + 1)[None, :], nd[:, None])
        drafts = np.full((len(nd), width), -1, np.int64)
        for i, row in enumerate(prep.sample_rows.tolist()):
            d = self._drafts.get(row)
            if d is not None:
                drafts[i, :len(d)] = d
        return {"spec_index": index, "spec_drafts": drafts}

    @staticmethod
    def finish(batch: InputBatch, v: Verified, seq_ids: list[int], tokens: list[int],
               logprobs, top_ids, top_vals, result) -> list[tuple[int, list[int]]]:
        """Fills ``result`` with each sequence's emitted tokens (accepted drafts, then the
        target's token; cut after a stop token), applies the stop rule and advances the mirror
        by what was accepted. Returns (index, tokens) of the rows that keep a history."""
        accepted = v.accepted.tolist()
        histories, pos = [], 0
        for i, (seq_id, row) in enumerate(zip(seq_ids, v.rows.tolist())):
            a, d = accepted[i], int(v.num_drafts[i])
            emitted = tokens[pos:pos + a + 1]
            stops = batch.stop_ids[row]
            if stops is not None:
                for j, t in enumerate(emitted):
                    if t in stops and v.num_output[i] + j + 1 >= batch.min_tokens[row]:
                        emitted = emitted[:j + 1]
                        result.stopped_seq_ids.append(seq_id)
                        if seq_id in batch.rows:
                            batch.stopped.add(seq_id)
                        break
            e = len(emitted)
            # launch counted one sample and d computed drafts; e tokens, a drafts' KV are valid
            batch.num_tokens[row] += e - 1
            batch.num_output[row] += e - 1
            batch.num_computed[row] -= d - min(a, e - 1)
            start = batch.num_tokens[row] - e
            batch.tokens[row, start:start + e] = emitted
            if batch.uses_history[row]:
                histories.append((i, emitted))
            result.seq_ids.append(seq_id)
            result.num_tokens.append(e)
            result.num_draft_tokens.append(d)
            result.token_ids.extend(emitted)
            if logprobs is not None:
                result.logprobs.extend(logprobs[pos:pos + e])
                for ids, vals in zip(top_ids[pos:pos + e], top_vals[pos:pos + e]):
                    result.top_token_ids.extend(ids)
                    result.top_logprobs.extend(vals)
            pos += d + 1
        return histories
