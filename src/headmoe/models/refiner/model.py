"""The MAGI-2 1080p refiner transformer (REFINER.md section 5), sharded over Ulysses SP.

Notation: N packed rows (N_local on this rank), C hidden size, Hq / Hkv query / KV heads
of D dims, B = D/8 rotary bands, I the MLP width, m(r) the modality of row r (video or
text; audio rows are handled the same way if present but the release has none).

    x [N_local, Cx] --embedder per m (fp32, -> C)--> cast to dtype: residual h
    per layer (pre-norm, two branches; weights per m in multimodal layers):
        a = RMSNorm(h) (1 + w_m)                            fp32
        q, k, v = a W_qkv^T; g = a W_g^T                    linears in dtype
        q, k <- rotary(RMSNorm_head(q|k) (1 + w)) on the first 6B dims   fp32
        Ulysses in (q, k, v in dtype) -> block-grid attention on this rank's heads
        (`headmoe.layers.range_attention`) -> Ulysses out
        h <- h + (o sigmoid(g)) W_proj^T                    (rounded to dtype)
        h <- h + W_down SwiGLU7(RMSNorm(h) (1 + w') W_up_gate^T)   in row chunks
    post-adapter on video rows (fp32): RMSNorm, final_linear_video -> 48; gather over SP

Dtypes (bf16 as released, or fp32: the same function with every cast a no-op): every
linear inside a layer takes dtype inputs and weights and gives a dtype-rounded result;
norms, rotary, the gate, SwiGLU7 and the adapters are fp32; the residual starts in dtype,
stays dtype after layer 0's attention add and is fp32 from layer 0's MLP add on (the
release's promotion, golden `bf16_dtypes`).

No time input, no sinks, no mHC, no MoE. Layout independence: every op but attention is
per row (`bi_linear`, position-independent activations), and the attention's calls depend
only on the packing (see `headmoe.layers.range_attention`), so every SP / CFG layout gives
the bits of one rank (tests/models/test_refiner_multirank.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from headmoe.config import DTYPES
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.exchange import ulysses_heads_to_seq, ulysses_seq_to_heads
from headmoe.distributed.sharding import sp_kv_heads
from headmoe.layers.activations import sigmoid, swiglu7
from headmoe.layers.linear import ModalityLinear
from headmoe.layers.norms import ModalityRMSNorm
from headmoe.layers.range_attention import range_attention
from headmoe.layers.range_plan import RangePlan
from headmoe.layers.rope import apply_rope
from headmoe.models.common import (
    PlannedModel,
    RowPlan,
    embed_rows,
    modality_groups,
    row_plan_fields,
    sp_counts,
)
from headmoe.models.magi2.config import VIDEO
from headmoe.models.magi2.model import PostAdapter, PreAdapter
from headmoe.models.refiner.config import Magi2RefinerConfig, validate_parallel
from headmoe.models.refiner.packing import RefinerPacked, attention_plan, pack_refiner, unpack_video
from headmoe.models.refiner.schedule import refiner_schedule

#: rows of the MLP processed at once (bounds the fp32 [rows, 2I] temporaries: 16,384 rows
#: of the released refiner hold 1.3 GiB of up_gate output in fp32)
MLP_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class RefinerPlan(RowPlan):
    """The `RowPlan` of one refiner forward on this rank, plus the attention `RangePlan`."""

    attn: RangePlan


class RefinerAttention(nn.Module):
    """Gated GQA attention over the block grid. `modalities` weight sets (3 in multimodal
    layers, else 1), stacked along the output dim (video, audio, text): pre_norm.weight
    `[m*C]`; linear_qkv.weight `[m*(Hq+2Hkv)*D, C]` (per set: q heads, k heads, v heads);
    linear_g.weight `[m*Hq, C]`; linear_proj.weight `[m*C, Hq*D]`; q_norm / k_norm.weight
    `[m*D]`."""

    def __init__(self, config: Magi2RefinerConfig, dtype: torch.dtype, modalities: int):
        super().__init__()
        c, d, m, eps = config.hidden_size, config.head_dim, modalities, config.norm_eps
        self.hq, self.hkv, self.head_dim, self.dtype = (
            config.num_attention_heads, config.num_query_groups, d, dtype)
        self.pre_norm = ModalityRMSNorm(m, c, eps)
        self.linear_qkv = ModalityLinear(m, c, config.qkv_width, dtype)
        self.linear_g = ModalityLinear(m, c, self.hq, dtype)
        self.linear_proj = ModalityLinear(m, self.hq * d, c, dtype)
        self.q_norm = ModalityRMSNorm(m, d, eps)
        self.k_norm = ModalityRMSNorm(m, d, eps)

    def _qkv(self, a: torch.Tensor, plan: RefinerPlan) -> tuple[torch.Tensor, ...]:
        """Normed, rotated q `[N_local, Hq, D]`, k and v `[N_local, Hkv, D]` in dtype."""
        n, d, hq, hkv = a.shape[0], self.head_dim, self.hq, self.hkv
        qkv = self.linear_qkv(a, plan.groups)
        q = qkv[:, : hq * d].view(n, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        q = apply_rope(self.q_norm(q, plan.modality), plan.cos, plan.sin)
        k = apply_rope(self.k_norm(k, plan.modality), plan.cos, plan.sin)
        return q.to(self.dtype), k.to(self.dtype), v.to(self.dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RefinerPlan
                ) -> torch.Tensor:
        """Ulysses in, attention on this rank's heads, Ulysses out: `[N_local, Hq, D]`.
        q, k and v travel in one all-to-all, each rank's heads side by side; KV heads are
        repeated to Hq first when the SP degree does not divide Hkv (`sp_kv_heads`)."""
        par = plan.parallel
        sp = par.sp
        scale = 1.0 / math.sqrt(self.head_dim)
        if sp == 1:
            return range_attention(q, k, v, plan.attn, scale)
        n, d = q.shape[0], self.head_dim
        if self.hkv % sp:
            k = k.repeat_interleave(self.hq // self.hkv, 1)
            v = v.repeat_interleave(self.hq // self.hkv, 1)
        lq, lk = par.heads(self.hq)[1], sp_kv_heads(self.hq, self.hkv, sp)
        packed = torch.cat([q.view(n, sp, lq, d), k.view(n, sp, lk, d), v.view(n, sp, lk, d)], 2)
        heads = ulysses_seq_to_heads(packed.view(n, sp * (lq + 2 * lk), d), par.sp_group,
                                     par.counts, counters=par.counters)
        o = range_attention(heads[:, :lq], heads[:, lq : lq + lk], heads[:, lq + lk :],
                            plan.attn, scale)
        return ulysses_heads_to_seq(o, par.sp_group, par.counts, counters=par.counters)

    def forward(self, h: torch.Tensor, plan: RefinerPlan) -> torch.Tensor:
        """h `[N_local, C]` residual -> the branch `[N_local, C]` in dtype."""
        a = self.pre_norm(h, plan.modality)
        gate = self.linear_g(a, plan.groups)
        q, k, v = self._qkv(a, plan)
        o = self._attend(q, k, v, plan)
        o = o.float() * sigmoid(gate)[:, :, None]
        out: torch.Tensor = self.linear_proj(o.reshape(h.shape[0], self.hq * self.head_dim),
                                             plan.groups)
        return out.to(self.dtype)


class RefinerMLP(nn.Module):
    """pre_norm.weight `[m*C]`; up_gate_proj.weight `[m*2I, C]` (per set: gate / linear
    interleaved, even / odd rows); down_proj.weight `[m*C, I]`."""

    def __init__(self, config: Magi2RefinerConfig, dtype: torch.dtype, modalities: int):
        super().__init__()
        c, i, m = config.hidden_size, config.intermediate_size, modalities
        self.pre_norm = ModalityRMSNorm(m, c, config.norm_eps)
        self.up_gate_proj = ModalityLinear(m, c, 2 * i, dtype)
        self.down_proj = ModalityLinear(m, i, c, dtype)

    def add_to(self, h: torch.Tensor, plan: RefinerPlan, chunk_rows: int) -> torch.Tensor:
        """`fp32(h) + MLP(h)` `[N_local, C]`, `chunk_rows` rows at a time (rows are
        independent, so the chunking does not change any bit)."""
        out = h.float()
        for a in range(0, h.shape[0], chunk_rows):
            b = min(a + chunk_rows, h.shape[0])
            mod = plan.modality[a:b]
            u = self.pre_norm(h[a:b], mod)
            groups = modality_groups(mod)
            out[a:b] += self.down_proj(swiglu7(self.up_gate_proj(u, groups)), groups)
        return out


class RefinerLayer(nn.Module):
    """Pre-norm attention then the MLP; `chunk_rows` bounds the MLP's fp32 temporaries."""

    def __init__(self, config: Magi2RefinerConfig, layer_id: int, dtype: torch.dtype,
                 chunk_rows: int = 0):
        super().__init__()
        sets = config.num_modalities if layer_id in config.multimodal_layers else 1
        self.attention = RefinerAttention(config, dtype, sets)
        self.mlp = RefinerMLP(config, dtype, sets)
        self.chunk_rows = chunk_rows

    def forward(self, h: torch.Tensor, plan: RefinerPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """h `[N_local, C]` residual -> `(residual after the layer, attention branch)`, both
        `[N_local, C]` (the residual dtype follows the module docstring's promotion)."""
        attn = self.attention(h, plan)
        return self.mlp.add_to(h + attn, plan, self.chunk_rows), attn


class RefinerBlock(nn.Module):
    def __init__(self, config: Magi2RefinerConfig, dtype: torch.dtype, chunk_rows: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(RefinerLayer(config, i, dtype, chunk_rows)
                                    for i in range(config.num_layers))


class Magi2Refiner(PlannedModel[RefinerPlan, RefinerPacked, tuple[torch.Tensor, torch.Tensor]]):
    """The refiner, sharded by the given `ParallelContext` (Ulysses SP; CFG and DP only
    choose which forwards a rank runs). `dtype` (fp32 or bf16) is the dtype of the layer
    linears. Parameters start at zeros; load weights with `load_refiner`. Inference only.
    `mlp_chunk_rows` bounds the MLP's fp32 temporaries (`MLP_CHUNK_ROWS`)."""

    def __init__(
        self, config: Magi2RefinerConfig, context: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32, mlp_chunk_rows: int = MLP_CHUNK_ROWS,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
        context = context if context is not None else ParallelContext.single()
        validate_parallel(config, context.config)
        self.config, self.context, self.dtype = config, context, dtype
        self.mlp_chunk_rows = mlp_chunk_rows
        self.pre_adapter = PreAdapter(config, width=config.hidden_size)
        self.block = RefinerBlock(config, dtype, mlp_chunk_rows)
        self.post_adapter = PostAdapter(config, width=config.hidden_size)

    @property
    def device(self) -> torch.device:
        return self.pre_adapter.video_embedder.weight.device

    def plan(self, packed: RefinerPacked) -> RefinerPlan:
        """This rank's `RefinerPlan` (host arithmetic, no collective)."""
        ctx = self.context
        counts = sp_counts(ctx, packed.num_tokens)
        schedule = refiner_schedule(self.config, ctx.topology, ctx.coords, counts)
        fields = row_plan_fields(ctx, counts, packed.modality, packed.coords,
                                 self.pre_adapter.rope.bands, self.device, schedule)
        return RefinerPlan(**fields, attn=attention_plan(packed))

    def _embed(self, packed: RefinerPacked, plan: RefinerPlan) -> torch.Tensor:
        """This rank's residual `[N_local, C]` in dtype."""
        x = packed.x[plan.lo : plan.hi].to(self.device)
        return embed_rows(self.pre_adapter.embedders(), x, plan.groups,
                          self.config.hidden_size).to(self.dtype)

    def _post(self, h: torch.Tensor, plan: RefinerPlan) -> torch.Tensor:
        """`[N_local, C]` -> `[N_local, C_video]` fp32 (rows of other modalities zero)."""
        post = self.post_adapter
        out = h.new_zeros((plan.local_tokens, self.config.video_in_channels), dtype=torch.float32)
        rows = plan.groups[VIDEO]
        if rows.numel():
            out[rows] = post.final_linear_video(post.final_norm_video(h[rows]))
        return out

    def _layers(self) -> Iterable[nn.Module]:
        return self.block.layers

    def _trace_in(self, trace: dict[str, torch.Tensor], state: torch.Tensor,
                  plan: RefinerPlan) -> None:
        trace["embed"] = state.clone()

    def _trace_layer(self, trace: dict[str, torch.Tensor], i: int,
                     out: tuple[torch.Tensor, torch.Tensor], plan: RefinerPlan) -> None:
        trace[f"layer{i}_attn"], trace[f"layer{i}_out"] = out[1].clone(), out[0].clone()

    @torch.no_grad()
    def forward_packed(
        self, packed: RefinerPacked, trace: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One forward on packed inputs (identical on every SP rank, host tensors).
        Returns the full `[N, C_video]` fp32 output rows (packed order; text rows zero) on
        every SP rank. `trace`, when given, receives this rank's rows (packed order, in the
        dtype they have in the forward) of `embed`, `layer{i}_attn` (the attention branch)
        and `layer{i}_out` (the residual after layer i). The collectives it issues are
        checked against its `refiner_schedule`."""
        return self.run_planned(packed, trace)

    def forward(self, video: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The flow velocity of one forward: video latent `[C_v, T, H, W]` fp32 and text
        features `[Lt, C_t]` fp32 (identical on every SP rank) -> `[C_v, T, H, W]` fp32 on
        every SP rank, on the input's device. Raises `ValueError` naming a bad input
        before any collective."""
        packed = pack_refiner(video, text, self.config)
        out = self.forward_packed(packed)
        return unpack_video(out, packed, self.config.video_in_channels).to(video.device)
