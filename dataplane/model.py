"""The decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 families) over a paged KV cache.

One flattened batch of tokens from many sequences runs through each layer at once; attention
reads and writes the paged cache through ``AttentionMetadata``. Projections are merged
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``); ``loader`` maps HF names onto them.

Under tensor parallelism (``headrace.dataplane.parallel``) the model is built from the rank's local
config (its heads, KV heads and MLP columns): ``qkv_proj``/``gate_up_proj`` are column-parallel,
``o_proj``/``down_proj`` row-parallel (all-reduced), the embedding and LM head vocab-parallel.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headrace import kernels
from headrace.dataplane import parallel
from headrace.dataplane.config import ModelConfig
from headrace.dataplane.rotary import cos_sin_cache


@dataclasses.dataclass
class AttentionMetadata:
    """Where the batch's tokens sit in the paged cache. All tensors live on the model's device."""

    slot_mapping: torch.Tensor     # [tokens] int64; -1 = do not write
    query_start_loc: torch.Tensor  # [seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [seqs] int32, context length after this step
    block_tables: torch.Tensor     # [seqs, max_blocks] int32, padded
    max_query_len: int | None = None  # host-side hints for the attention kernels
    decode_only: bool | None = None   # every sequence computes exactly one token
    num_decodes: int = 0              # the first num_decodes sequences compute one token each
    decode_order: torch.Tensor | None = None  # [decodes] int32: longest context first (a hint)
    flash: object | None = None       # the step's headrace.kernels.flash_attn4.Plan (--attention-backend)
    unified: bool = False             # one launch by token count (kernels.unified_attention): the
                                      # full graphs' static, padded metadata; the hints unused


class FromCheckpoint:
    """A layer whose parameters the loader writes (it zeroes them, then loads): no initialiser
    runs. The loader builds the model on the meta device, where torch's initialisers
    (``normal_``, ``kaiming_uniform_``) run through its Python decompositions, whose first call
    imports ``torch._dynamo``: ~2 s of every data plane's start on a CPU."""

    def reset_parameters(self) -> None:
        pass


class LMHead(FromCheckpoint, nn.Linear):
    """The vocabulary projection's weight (``CausalLM.logits`` reads it)."""


class Linear(FromCheckpoint, nn.Linear):
    """nn.Linear through ``kernels.linear`` (a skinny-input kernel at decode batch sizes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)

    def wants_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer takes x as ``kernels.Fp8Rows`` (an FP8 layer's W8A8 input)."""
        return False


class RowParallelLinear(Linear):
    """Holds the rank's input columns; the partial products are summed across ranks, then the
    (replicated) bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel.world_size() == 1:
            return super().forward(x)
        y = parallel.all_reduce(kernels.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(FromCheckpoint, nn.Embedding):
    """Holds rows [start, start + num_embeddings) of the (padded) vocabulary; ids outside
    them contribute zeros, and the ranks' lookups are summed."""

    def __init__(self, num_embeddings: int, dim: int, start: int):
        super().__init__(num_embeddings, dim)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel.world_size() == 1:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        h = torch.nn.functional.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return parallel.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.cos_sin = cos_sin
        self.scale = cfg.head_dim ** -0.5
        self.k_scale = self.v_scale = 1.0   # FP8 KV cache: stored = k / k_scale (the loader's)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q = self.prologue(positions, h, kv_cache, meta.slot_mapping)
        return self.o_proj(self.attend(q, kv_cache, meta).reshape(-1, self.cfg.q_size))

    def prologue(self, positions: torch.Tensor, h: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> torch.Tensor:
        """q [tokens, heads, head_dim] (normed, rotated); k and v written to their slots."""
        cfg = self.cfg
        q, k, v = self.qkv_proj(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        return kernels.qk_norm_rope_write_kv(
            q, k, v, positions, self.cos_sin, self.q_norm.weight if cfg.qk_norm else None,
            self.k_norm.weight if cfg.qk_norm else None, cfg.rms_norm_eps, kv_cache,
            slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Paged attention of ``q`` over the cache (into ``out`` when given)."""
        if meta.unified:
            return kernels.unified_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                             meta.block_tables, self.scale, k_scale=self.k_scale,
                                             v_scale=self.v_scale, out=out)
        return kernels.paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                       meta.block_tables, self.scale,
                                       max_query_len=meta.max_query_len, decode_only=meta.decode_only,
                                       num_decodes=meta.num_decodes, decode_order=meta.decode_order,
                                       k_scale=self.k_scale, v_scale=self.v_scale, flash=meta.flash,
                                       out=out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.down_proj.wants_fp8_rows(gate_up):
            return self.down_proj(kernels.silu_and_mul_fp8(gate_up))
        return self.down_proj(kernels.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor):
        super().__init__()
        self.self_attn = Attention(cfg, cos_sin)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, h, residual, kv_cache, meta):
        q, residual = self.pre_attention(positions, h, residual, kv_cache, meta.slot_mapping)
        return self.post_attention(self.self_attn.attend(q, kv_cache, meta), residual)

    # The layer's halves around attention: ``headrace.dataplane.mixed_graphs`` captures them in CUDA
    # graphs and launches the attention between them.

    def pre_attention(self, positions, h, residual, kv_cache, slot_mapping):
        """(q, residual): the input norm, the q/k/v projection and the attention prologue."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = _add_norm(h, residual, self.input_layernorm, self.self_attn.qkv_proj)
        return self.self_attn.prologue(positions, h, kv_cache, slot_mapping), residual

    def post_attention(self, o, residual):
        """(h, residual) from the attention's output o: o_proj, the post-attention norm, MLP."""
        h = self.self_attn.o_proj(o.reshape(-1, self.self_attn.cfg.q_size))
        h, residual = _add_norm(h, residual, self.post_attention_layernorm, self.mlp.gate_up_proj)
        return self.mlp(h), residual


def _add_norm(h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, consumer: nn.Module):
    """(norm(h + residual), h + residual); the first as ``kernels.Fp8Rows`` where the layer
    that consumes it wants its input quantised (an FP8 layer's W8A8 GEMM)."""
    if consumer.wants_fp8_rows(h):
        return kernels.fused_add_rms_norm_fp8(h, residual, norm.weight, norm.eps)
    return kernels.fused_add_rms_norm(h, residual, norm.weight, norm.eps)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, shard: parallel.Shard):
        super().__init__()
        if torch.empty(0).is_meta:   # built on the meta device: the loader sets the real table
            # (computing it here on meta runs torch's Python decompositions, which import
            # torch._dynamo: ~2 s of every data plane's start on a CPU)
            cos_sin = torch.empty(max_positions, cfg.head_dim)
        else:
            cos_sin = cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab_per_rank, cfg.hidden_size,
                                                   shard.vocab_start)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cos_sin) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        h, residual = self.embed_tokens(input_ids), None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(positions, h, residual, cache, meta)
        return self.final_norm(h, residual)

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return kernels.fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]


class CausalLM(nn.Module):
    """``forward`` returns final hidden states; ``logits`` projects selected rows to the vocab.
    ``cfg`` is the whole model's config; the layers are built from ``shard``'s part of it."""

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: parallel.Shard | None = None):
        super().__init__()
        self.shard = shard = shard or parallel.Shard.of(cfg)
        self.cfg = local = shard.local_config(cfg)
        self.model = DecoderModel(local, max_positions, shard)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg.hidden_size, shard.vocab_per_rank, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, vocab] logits of ``hidden``'s rows (written into ``out`` when given: the
        CUDA graphs' one static logits buffer)."""
        weight = (self.model.embed_tokens.weight if self.cfg.tie_word_embeddings
                  else self.lm_head.weight)
        if kernels.batch_invariant.ENABLED:   # --deterministic: the head batch-invariant too
            logits = kernels.linear(hidden, weight)
        elif self.shard.world == 1 and out is not None:
            return torch.mm(hidden, weight.t(), out=out)
        else:
            logits = torch.nn.functional.linear(hidden, weight)
        if self.shard.world > 1:
            logits = parallel.all_gather_last(logits)[:, :self.shard.vocab_size]
        return logits if out is None else out.copy_(logits)

    def rebind_rotary(self) -> None:
        """Points every layer at the module's own cos/sin buffer (after a device move)."""
        for layer in self.model.layers:
            layer.self_attn.cos_sin = self.model.cos_sin
