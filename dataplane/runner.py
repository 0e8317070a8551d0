"""Executes steps: applies the control plane's step delta to the persistent ``InputBatch``
(``step_delta``), runs the model over the paged KV cache (``forward``: a full CUDA graph for
decode-only steps and verifies of decodes only, piecewise graphs for prefill and mixed steps,
eagerly otherwise) and samples. Each launched step records its host time per phase (apply
the delta, build and upload the inputs, launch the forward, launch sampling) in
``Launched.host_ms``, and its kind and graph mode, for the metrics and ``bench/step_host.py``.

The mirror is updated only from StepRequests (the control plane decides everything); the
runner keeps each sequence's last token on the device, so a decode reads the token sampled
by the step before without the host ever seeing it first. ``launch`` enqueues a step's device
work and returns at once; ``finish`` waits for its sampled ids and builds the StepResult.
Launching step N+1 before finishing step N keeps the GPU busy while the host reads N's ids
and the control plane processes them (the control plane's overlapped scheduling). With a
third step in flight, a sequence whose sampled token is one of its stop tokens is left out of
the steps that were sent before the control plane saw that token (one wasted slot at most).

Structured outputs: a step's constrained rows come with packed token bitmasks
(``headrace.dataplane.bitmasks``), uploaded with the step's inputs and applied to the logits on the
device before sampling. A step sent with ``bitmask_follows`` is launched up to its logits and
sampled by ``sample_late`` when its bitmasks arrive (the forward pass runs meanwhile). A step
that comes while they are awaited has its host half done then (``prepare_ahead``: the delta,
the inputs packed into a pinned buffer); launching it later only queues its device work. So
a launched step counts its rows' samples (positions, histories, the stop watch) at launch,
before the next step's delta may give their rows to other sequences.

Under tensor parallelism every rank runs every step; the logits are gathered on every rank,
rank 0 alone samples and broadcasts the token ids, so every rank's ``last_token`` table (and
token history) holds the same ids whatever the sampling parameters or RNG states.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from headrace import kernels
from headrace.common import stage_times
from headrace.dataplane import (bitmasks, kv_offload, late_sampling, parallel, staging, step_delta,
                                step_result)
from headrace.dataplane.forward import StepForward, step_kind
from headrace.dataplane.input_batch import BatchError, InputBatch, PreparedBatch
from headrace.dataplane.late_sampling import LateSampler
from headrace.dataplane.launched import Launched, Prepared
from headrace.dataplane.model import CausalLM
from headrace.dataplane.lora import batch as lora_batch
from headrace.dataplane.sampler import (SampleOutput, SamplingBatch, device_arrays, sample,
                                        with_default_seed)
from headrace.dataplane.spec_decode import SpecDecoder, Verified, verify
from headrace.dataplane.step_delta import StepRows
from headrace.worker.v1 import worker_pb2 as pb


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, max_model_len: int, max_num_seqs: int = 256,
                 graphs=None, rank: int = 0, seed: int | None = None, spec: SpecDecoder | None = None,
                 attention=None, host_kv: kv_offload.HostKV | None = None, mixed=None,
                 deterministic: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = kv_caches[0].shape[1]
        self.device = device
        self.max_model_len = max_model_len
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.num_blocks,
                                keep_tokens=spec is not None)
        self.spec = spec
        self.draft = spec.draft if spec is not None else None   # headrace.dataplane.draft_model.DraftModel
        self.host_kv = host_kv   # the host KV tier (headrace.dataplane.kv_offload), or None
        self.index = step_delta.RowIndex(self.batch)   # seq ids -> rows, by array
        self.seq_of_row = np.zeros(max_num_seqs, dtype=np.int64)
        # by row; one slot more, where late sampling's padded rows write (``late_sampling``)
        self.last_token = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        # how each step's forward runs: decode graphs, piecewise (mixed) graphs, or eagerly
        self.forward = StepForward(model, kv_caches, device, max_num_seqs, graphs, mixed,
                                   self.draft, attention)
        self.stager = staging.Stager(device)   # a step's inputs: one copy, from pinned buffers
        self.lora = getattr(model, "lora", None)   # --enable-lora: headrace.dataplane.lora.batch.LoraBatch
        self.rank = rank
        self.rng = np.random.default_rng(seed)   # seeds of the unseeded rows' sampling noise
        # --deterministic: unseeded rows take ``seed`` itself (no fresh noise a step)
        self.default_seed = (seed or 0) if deterministic else None
        self._last_done: torch.cuda.Event | None = None
        self._ahead: Prepared | None = None   # a step's host half, done ahead (``prepare_ahead``)
        self._late: LateSampler | None = None   # late sampling's graphs, made at their first use

    # The forward's graphs and attention policy, as the worker (and tests) set them.
    graphs = property(lambda self: self.forward.graphs,
                      lambda self, g: setattr(self.forward, "graphs", g))   # DecodeGraphs or None
    mixed = property(lambda self: self.forward.mixed,
                     lambda self, g: setattr(self.forward, "mixed", g))     # MixedGraphs or None
    attention = property(lambda self: self.forward.attention,
                         lambda self, a: setattr(self.forward, "attention", a))

    def reset(self) -> None:
        """Forgets every sequence (a new control plane stream starts from nothing)."""
        self.batch.clear()
        self._ahead = None

    def _host_arrays(self, step: pb.StepRequest, prep: PreparedBatch, mode: str, delta: StepRows,
                     sampling: SamplingBatch | None) -> dict[str, np.ndarray]:
        """Every array the step's device work reads, to be uploaded in one copy."""
        arrays = self.forward.host_arrays(prep, mode)
        if not prep.decode_only:   # the rows whose sampled token becomes their last
            arrays.update(sample_rows=prep.sample_rows)
        if delta.new_rows:
            arrays.update(new_rows=np.asarray(delta.new_rows, dtype=np.int64),
                          new_last=np.asarray(delta.new_last, dtype=np.int64))
        if step.copy_src_blocks:
            arrays.update(copy_src=np.asarray(step.copy_src_blocks, dtype=np.int64),
                          copy_dst=np.asarray(step.copy_dst_blocks, dtype=np.int64))
        if sampling is not None and self.rank == 0:
            arrays.update({"s_" + k: v for k, v in device_arrays(sampling, self.rng).items()})
        if prep.num_drafts is not None:
            arrays.update(self.spec.verify_arrays(prep))
        return arrays

    @torch.inference_mode()
    def launch(self, step: pb.StepRequest) -> Launched:
        """Enqueues the step's device work (inputs in one upload, forward, sampling, the copy of
        the sampled ids to the host) without waiting for the device; its host half is done
        already when ``prepare_ahead`` had it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.step is not step:
            raise BatchError(f"step {step.step_id} launched while step {ahead.step.step_id} was prepared")
        return self._enqueue(ahead or self._prepare(step))

    @torch.inference_mode()
    def prepare_ahead(self, step: pb.StepRequest) -> None:
        """The host half of ``launch`` (the delta, the inputs, their packing: everything but
        device work) for a step that came while the step before waits for its bitmasks: the
        worker's host is idle then, and once they come ``launch`` only queues this step's
        device work behind that step's sampling (a constrained step's critical path is the
        round trip of its token through the control plane, not this host work). The step
        before has counted its sample already (``_count``), so this one's positions are
        right."""
        self._ahead = self._prepare(step)

    def _prepare(self, step: pb.StepRequest) -> Prepared:
        clock = time.perf_counter
        launched = Launched(step.step_id, clock())
        delta = step_delta.apply(self.batch, self.index, step, self.seq_of_row, self.num_blocks,
                                 self.spec is not None)
        kv_offload.check_step(self.host_kv, step)
        if step.lora_loads or step.lora_drops or self.batch.num_lora_rows:   # slots, before the forward
            lora_batch.apply_loads(self.lora, step, self.batch.num_lora_rows)
        if len(delta.rows) == 0:   # every sequence of the step stopped: its block copies still run
            return Prepared(step, launched, delta)
        batch, rows = self.batch, delta.rows
        drafts = self.spec.propose(batch, rows, delta.spec, bitmasks.checked_drafts(step, batch.rows)) \
            if delta.spec.any() else None
        t_apply = clock()
        prep = batch.prepare(rows, delta.counts if drafts is None else delta.counts + drafts, drafts)
        sample_rows = prep.sample_rows
        if drafts is not None:
            SpecDecoder.unpropose(batch, rows, drafts)
        if prep.num_drafts is not None:
            sampling = self.spec.sampling_batch(batch, prep)
            launched.verified = Verified(sample_rows, prep.num_drafts,
                                         batch.num_output[sample_rows].copy(), None)
        else:
            sampling = batch.sampling_batch(sample_rows) if len(sample_rows) else None
        if sampling is not None and self.default_seed is not None:
            sampling = with_default_seed(sampling, self.default_seed)
        if batch.tokens is not None:
            launched.token_rows, launched.token_pos = sample_rows, batch.num_tokens[sample_rows].copy()
        launched.kind, launched.graph = step_kind(prep), self.forward.mode(prep)
        host = self._host_arrays(step, prep, launched.graph, delta, sampling)
        if sampling is not None:
            self._count(launched, sample_rows)
            if self.rank == 0 and step.HasField("bitmask"):
                host.update(self._bitmask_arrays(step.bitmask, launched, prep))
        packed = self.stager.pack(host)
        launched.host_ms.update(apply=(t_apply - launched.started) * 1e3, build=(clock() - t_apply) * 1e3)
        return Prepared(step, launched, delta, prep, sampling, packed)

    def _enqueue(self, p: Prepared) -> Launched:
        step, launched, prep = p.step, p.launched, p.prep
        if prep is None:   # no row left: only the step's block copies
            kv_offload.apply_step(self.host_kv, self.kv_caches, step, self._copier(step, None))
            return self._nothing_sampled(step, launched)
        t_enqueue = time.perf_counter()
        dev = self.stager.copy(p.packed)
        if self.device.type == "cuda":   # after the upload is queued: host packing is not device time
            launched.begin, launched.previous = torch.cuda.Event(enable_timing=True), self._last_done
            launched.begin.record()
        if p.delta.new_rows:
            self.last_token[dev["new_rows"]] = dev["new_last"]
        kv_offload.apply_step(self.host_kv, self.kv_caches, step, self._copier(step, dev),
                              reads=prep.block_tables)
        logits = self.forward.logits(prep, dev, launched.graph, self.last_token)
        launched.host_ms["forward"] = (time.perf_counter() - t_enqueue) * 1e3
        if p.sampling is None:   # a step of prefill chunks only: KV written, nothing sampled
            return self._record_done(self._nothing_sampled(step, launched))
        if step.bitmask_follows:   # sampled by ``sample_late``; the forward pass runs meanwhile
            launched.awaiting = (logits, p.sampling, dev, prep, p.packed.arrays)
            if self.device.type == "cuda":
                launched.logits_ready = torch.cuda.Event()
                launched.logits_ready.record()
            return launched
        return self._sample_step(launched, logits, p.sampling, dev)

    @staticmethod
    def _nothing_sampled(step: pb.StepRequest, launched: Launched) -> Launched:
        """A step none of whose rows samples. Sent with ``bitmask_follows`` (its rows stopped
        at the step before, answered before this one came): its late bitmasks still come, and
        complete nothing."""
        if step.bitmask_follows:
            launched.awaiting = ()
        return launched

    def _count(self, launched: Launched, sample_rows: np.ndarray) -> None:
        """The rows that sample count their token now (its value comes later): the sequences,
        the rows that keep a history, and those that may stop on it."""
        seq_ids = self.seq_of_row[sample_rows]
        launched.seq_ids = seq_ids.tolist()
        keep = self.batch.history_mask(sample_rows)
        launched.histories = list(zip(np.flatnonzero(keep).tolist(), self.batch.count_sampled(sample_rows)))
        launched.stop_watch = self.batch.stop_watch(sample_rows, seq_ids)

    def _bitmask_arrays(self, bitmask: pb.TokenBitmask, launched: Launched,
                        prep: PreparedBatch) -> dict[str, np.ndarray]:
        return bitmasks.arrays(bitmask, np.asarray(launched.seq_ids, dtype=np.int64), prep.num_drafts,
                               self.model.shard.vocab_size)

    @torch.inference_mode()
    def sample_late(self, launched: Launched, step: pb.StepRequest) -> Launched:
        """Samples a step launched with ``bitmask_follows``, with the bitmasks ``step``
        (``late_bitmask``) brings."""
        if launched.awaiting is None or launched.step_id != step.step_id:
            raise BatchError(f"late bitmasks for step {step.step_id}, which waits for none")
        awaiting, launched.awaiting = launched.awaiting, None
        if not awaiting:   # nothing left to sample: its rows stopped at the step before
            return launched
        logits, sampling, dev, prep, host = awaiting
        if self.rank != 0:
            return self._sample_step(launched, logits, sampling, dev)
        masks = self._bitmask_arrays(step.bitmask, launched, prep)
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(f"step:{step.step_id}", "w_masks")
        late = self._late_sampler()
        if late is not None and late.takes(logits, sampling, launched.verified is not None, masks):
            return self._sample_step(launched, logits, sampling, dev,
                                     replay=lambda: late.sample(logits, host, masks))
        return self._sample_step(launched, logits, sampling, dev | self.stager.upload(masks))

    def _late_sampler(self) -> LateSampler | None:
        """Late sampling's graphs (none under tensor parallelism: the ids' broadcast)."""
        if self._late is None and parallel.world_size() == 1:
            self._late = late_sampling.over_step_graphs(self.graphs, self.mixed, self.last_token)
        return self._late

    def _sample_step(self, launched: Launched, logits: torch.Tensor, sampling: SamplingBatch,
                     dev: dict[str, torch.Tensor], replay=None) -> Launched:
        """Samples the launched step's logits, keeps the ids on the device for the next step
        and queues their copy to the host (``replay``: a late sampling graph does all that)."""
        t_sample = time.perf_counter()
        if launched.begin is not None:
            launched.sample_begin = torch.cuda.Event(enable_timing=True)
            launched.sample_begin.record()
        if replay is not None:
            out = replay()
        else:
            out = self._sample(logits, sampling,
                               {k[2:]: v for k, v in dev.items() if k.startswith("s_")})
            last = out.token_ids
            if launched.verified is not None:
                accepted, last = verify(out.token_ids, dev["spec_index"], dev["spec_drafts"])
                launched.verified.accepted = staging.download(accepted)
            self.last_token[dev.get("sample_rows", dev["last_rows"])] = last
            out.start_download()
        launched.sample_ms = (time.perf_counter() - t_sample) * 1e3   # CPU: the sampling itself
        launched.out = out
        launched.host_ms["sample"] = launched.sample_ms
        return self._record_done(launched)

    def _copier(self, step: pb.StepRequest, dev: dict | None):
        """The step's copy-on-write block copies as a call (None: none), from the uploaded
        arrays, or from the message when nothing was uploaded."""
        if not step.copy_src_blocks:
            return None
        if dev is None:
            dev = {k: torch.as_tensor(list(b), dtype=torch.int64).to(self.device)
                   for k, b in (("copy_src", step.copy_src_blocks), ("copy_dst", step.copy_dst_blocks))}
        caches = self.kv_caches if self.draft is None else self.kv_caches + self.draft.kv_caches
        return functools.partial(kernels.copy_blocks, caches, dev["copy_src"], dev["copy_dst"])

    def _record_done(self, launched: Launched) -> Launched:
        if launched.begin is not None:
            launched.done = self._last_done = torch.cuda.Event(enable_timing=True)
            launched.done.record()
        return launched

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch,
                dev: dict[str, torch.Tensor]) -> SampleOutput:
        """Rank 0 samples; with more ranks it broadcasts the ids (the others get ids only)."""
        if self.rank == 0:
            out = sample(logits, sampling, dev)
        else:
            out = SampleOutput(torch.empty(logits.shape[0], dtype=torch.int64, device=self.device),
                               None, None, None, [])
        if parallel.world_size() > 1:
            out.token_ids = parallel.broadcast(out.token_ids.contiguous(), 0)
        return out

    def needs_history(self, step: pb.StepRequest) -> bool:
        """Whether the step may sample a sequence whose penalties need its token history, or
        may speculate (drafts come from the token mirror): then the step before must be
        finished first, so that history is complete."""
        if self.spec is not None and any(step.running_num_spec):
            return True
        if self.batch.num_history_rows == 0:   # the common case costs nothing per step
            return False
        rows, found = self.index.lookup(np.array(step.running_seq_ids, dtype=np.uint64))
        return bool(self.batch.history_mask(rows[found]).any())

    @torch.inference_mode()
    def finish(self, launched: Launched) -> pb.StepResult:
        """Waits for the launched step's sampled ids; its StepResult (``step_result``)."""
        return step_result.build(self.batch, self.seq_of_row, self.host_kv, launched)
