"""Full CUDA graphs of prefill and mixed steps: one graph per token-count bucket holds the whole
forward (embedding, every layer with its attention, the final norm, the gather of the rows that
sample), as vLLM's FULL mode does over its unified attention metadata (``--cudagraph-mode
full``).

Why: the piecewise graphs (``mixed_graphs``) launch every layer's attention eagerly between
the pieces; on the H200 a piecewise mixed step of 256 decodes + a 512-token chunk spent ~7 ms
of host time in its forward for ~7.5 ms of device time (29 replays + 28 layers of Triton
launches, ~140-250 µs of Python per layer), so the device waited on the host, whereas a full
decode graph ran 256 decodes in 2.9 ms of device with 0.3 ms of host. Here the attention is
``headrace.kernels.triton_unified`` (one launch whose grid depends on the bucket's token count only)
reading static metadata buffers, so the step is one replay: its host cost is the input copies
and two replays (the body, then the LM head), whatever the batch's mix.

Static inputs, as the piecewise graphs': ``rows`` (ids, positions, slots padded with -1: no
KV written for padding, sampled token indices), plus ``meta`` [2, max_seqs + 1] int32 (the
step's ``query_start_loc`` continued at its token count, so the padded sequences have no query,
and its ``seq_lens`` padded with 0; uploaded pre-padded with the step's inputs, one copy) and
``block_tables`` [max_seqs, max_blocks] (the step's rows and columns copied in; a sequence
never reads past its context, so stale entries elsewhere are never read). Padded token rows
belong to no sequence: attention leaves their rows as they were, and every other kernel is
row-wise, so they never reach a real row; the sampler reads the real rows' logits only.

The LM head stays a second replay from the piecewise graphs' ladder of row counts (the rows
that sample, not the bucket's: a 2048-token prefill samples a few rows), one more graph launch
(a few µs) for up to ``max_rows``x the head's GEMM of device time saved. Decode-only steps keep
the decode graphs (``cuda_graphs.DecodeGraphs``: the split-KV decode kernel spreads long
contexts over the SMs, which a decode row of the unified kernel does not). Off CUDA each graph
is a stand-in (``mixed_graphs.EagerPiece``) running the same body over the same buffers.

Not here: flash-attn-4 (``--attention-backend``) runs outside graphs only, so a step replayed
here uses the Triton kernel whatever the policy says (eager steps, beyond the largest bucket,
keep the policy).
"""

from __future__ import annotations

import numpy as np
import torch

from headrace.dataplane.mixed_graphs import MixedGraphs
from headrace.dataplane.model import AttentionMetadata, CausalLM


class FullGraphs(MixedGraphs):
    """One graph per bucket (``mixed_graphs.token_buckets``) and the LM-head ladder.
    ``max_seqs``: the most sequences one step holds; ``max_blocks``: block-table width."""

    label = "full"

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], max_tokens: int,
                 max_rows: int, max_seqs: int, max_blocks: int, device: torch.device,
                 logits: torch.Tensor | None = None):
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        super().__init__(model, kv_caches, max_tokens, max_rows, device, logits=logits)

    def _buffers(self, max_tokens: int, act: dict) -> list[torch.Tensor]:
        i32 = dict(dtype=torch.int32, device=self.device)
        self.meta = torch.zeros((2, self.max_seqs + 1), **i32)
        self.query_start_loc, self.seq_lens = self.meta[0], self.meta[1, :self.max_seqs]
        self.block_tables = torch.zeros((self.max_seqs, self.max_blocks), **i32)
        return [self.meta, self.block_tables]

    @property
    def pieces_per_bucket(self) -> int:
        return 1

    def _piece(self, size: int, k: int) -> None:
        """The bucket's whole forward over the static buffers, up to the sampled rows."""
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size],
                                 query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                 block_tables=self.block_tables, unified=True)
        h = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        rows = min(size, self.max_rows)
        torch.index_select(h, 0, self.sample_index[:rows], out=self.sampled[:rows])

    def fits(self, num_tokens: int, num_rows: int, num_seqs: int = 0) -> bool:
        return super().fits(num_tokens, num_rows) and num_seqs <= self.max_seqs

    def meta_arrays(self, prep) -> dict[str, np.ndarray]:
        """``graph_meta``: the step's query offsets and context lengths, padded to max_seqs."""
        seqs = len(prep.seq_lens)
        meta = np.zeros((2, self.max_seqs + 1), dtype=np.int32)
        meta[0, :seqs + 1] = prep.query_start_loc
        meta[0, seqs + 1:] = prep.query_start_loc[-1]
        meta[1, :seqs] = prep.seq_lens
        return {"graph_meta": meta}

    def run(self, rows: torch.Tensor, num_tokens: int, num_rows: int, meta: AttentionMetadata,
            last_index: torch.Tensor | None = None, last_tokens: torch.Tensor | None = None,
            graph_meta: torch.Tensor | None = None) -> torch.Tensor | None:
        """As ``MixedGraphs.run``; ``graph_meta`` (``meta_arrays``, uploaded) and ``meta``'s
        block tables are copied into the static metadata, then one replay runs the step."""
        size = rows.shape[1]
        self.rows[:, :size].copy_(rows)
        self.meta.copy_(graph_meta)
        tables = meta.block_tables
        self.block_tables[:tables.shape[0], :tables.shape[1]].copy_(tables)
        if last_index is not None and len(last_index):
            self.input_ids[last_index] = last_tokens
        self.pieces_of(size)[0].replay()
        self.num_replays += 1
        return self._replay_head(num_rows)
