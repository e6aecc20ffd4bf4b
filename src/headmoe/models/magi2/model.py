"""The MAGI-2 Preview transformer (MAGI2.md section 3), sharded over SP, CFG and head EP.

Notation: T packed tokens (T_local on this rank), C hidden size, n mHC streams, V = n*C,
Hq / Hkv query / KV heads of D dims, B = D/8 rotary bands, m the modality of a row.

Data path of one forward on one rank (rows in sequence order; "per m" = one weight set
per modality in multimodal layers, applied to the rows of that modality):

    x [T_local, Cx] --pre-adapter per m (fp32, -> V)--> cast to dtype, time sinusoid into
    columns 0..63 --> state S [T_local, n, C] (model dtype)
    for each layer, for branch in (attention, MLP):
        mix = mHC coefficients of S (fp32; mhc_norm per m in multimodal layers)
        u = sum_i pre_i S_i (-> dtype);  y = F(u);  S <- H_res S + post y (-> dtype)
    post-adapter per m (fp32, RMSNorm over V -> 48 / 64) --> all-gather over SP --> [T, 64]

Sharding. Every op except attention and the MoE experts is row-local and runs on this
rank's contiguous shard of the packed rows (`sp_token_counts`). Attention moves q, k, v to
head shards with one Ulysses all-to-all, attends per segment, and moves the output back;
MoE layers exchange over their EP group (or the SP group with replicas) inside
`MultiHeadMoE`. The SP token counts are computed once per forward on the host.

Layout independence. Every product over a layout-dependent number of rows goes through
`bi_linear` / `bi_matmul`; position tables are per-row functions of the packed coordinates;
sums over streams run in a fixed order; attention runs per segment. So a row's bits do not
depend on the layout (tests/models/test_magi2_multirank.py checks them with torch.equal).

Dtypes (model dtype bf16 as released, or fp32): adapters, norms, mHC coefficients, the
router, attention softmax, SwiGLU7 and the post-adapter compute in fp32; linears and experts
in the model dtype; the state S between layers and the branch inputs u in the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from headmoe.config import DTYPES
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.exchange import (
    ExchangeWorkspace,
    ulysses_heads_to_seq,
    ulysses_qkv_to_heads,
)
from headmoe.layers.activations import sigmoid
from headmoe.layers.attention import segment_attention
from headmoe.layers.linear import Fusion, Linear, LinearInput, ModalityLinear
from headmoe.layers.mhc import mhc_input, mhc_mix, mhc_update
from headmoe.layers.norms import ModalityRMSNorm, RMSNorm
from headmoe.layers.rope import apply_rope, default_bands
from headmoe.models.common import PlannedModel, RowPlan, embed_rows, row_plan_fields, sp_counts
from headmoe.models.magi2.config import AUDIO, VIDEO, Magi2Config, TransformerShape
from headmoe.models.magi2.config import validate_parallel as _validate_parallel
from headmoe.models.magi2.packing import (
    BranchInput,
    BranchOutput,
    PackedInputs,
    pack_branches,
    unpack_outputs,
)
from headmoe.models.magi2.schedule import forward_schedule
from headmoe.moe import MoEConfig, MultiHeadMoE
from headmoe.moe.weights import Bf16Experts, ExpertWeights


@dataclass(frozen=True)
class ForwardPlan(RowPlan):
    """The `RowPlan` of one MAGI-2 forward on this rank, plus `segments`: each packed
    segment's global `(start, stop)`."""

    segments: list[tuple[int, int]]


class Attention(nn.Module):
    """Gated attention with q/k RMSNorm, 3-D rotary, a learned sink per head and Ulysses SP.

    `modalities` weight sets (3 in multimodal layers, else 1), stored modality-major:
    pre_norm.weight `[m*C]`; linear_g.weight `[m*Hq, C]`; linear_qkv.weight
    `[m*(Hq+2Hkv)*D, C]` (per set: q heads, k heads, v heads); linear_proj.weight
    `[m*C, Hq*D]`; q_norm / k_norm.weight `[m*D]`; sinks `[1, Hq]` fp32."""

    def __init__(self, config: Magi2Config, dtype: torch.dtype, modalities: int) -> None:
        super().__init__()
        c, d = config.hidden_size, config.head_dim
        self.hq, self.hkv, self.head_dim = config.num_attention_heads, config.num_query_groups, d
        self.dtype = dtype
        m, eps = modalities, config.norm_eps
        self.sinks = nn.Parameter(torch.zeros(1, self.hq, dtype=torch.float32))
        self.pre_norm = ModalityRMSNorm(m, c, eps)
        self.linear_g = ModalityLinear(m, c, self.hq, dtype)
        self.linear_qkv = ModalityLinear(m, c, config.qkv_width, dtype)
        self.linear_proj = ModalityLinear(m, self.hq * d, c, dtype)
        self.q_norm = ModalityRMSNorm(m, d, eps)
        self.k_norm = ModalityRMSNorm(m, d, eps)

    def _qkv(self, x: LinearInput, plan: ForwardPlan) -> torch.Tensor:
        """Normed, rotated q, k, v `[T_local, 3, Hq, D]` in the model dtype (KV heads
        repeated for GQA: query head h reads KV head h // (Hq/Hkv))."""
        d, hq, hkv = self.head_dim, self.hq, self.hkv
        qkv = self.linear_qkv(x, plan.groups)
        t = qkv.shape[0]
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        q = apply_rope(self.q_norm(q, plan.modality), plan.cos, plan.sin)
        k = apply_rope(self.k_norm(k, plan.modality), plan.cos, plan.sin)
        if hkv != hq:
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        return torch.stack([q, k, v], dim=1).to(self.dtype)

    def forward(self, u: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """u `[T_local, C]` (model dtype) -> `[T_local, C]` fp32."""
        t, par = u.shape[0], plan.parallel
        x = self.pre_norm.folded(u, plan.modality, plan.groups)
        gate = self.linear_g(x, plan.groups)
        qkv = self._qkv(x, plan)
        if par.sp > 1:
            qkv = ulysses_qkv_to_heads(qkv, par.sp_group, par.counts, counters=par.counters)
        first, local = par.heads(self.hq)
        sinks = self.sinks[0, first : first + local]
        o = segment_attention(qkv, plan.segments, sinks, 1.0 / math.sqrt(self.head_dim))
        if par.sp > 1:
            o = ulysses_heads_to_seq(o, par.sp_group, par.counts, counters=par.counters)
        out: torch.Tensor = self.linear_proj(o.reshape(t, self.hq * self.head_dim), plan.groups,
                                             Fusion(gate=sigmoid(gate)))
        return out


class DenseMLP(nn.Module):
    """Multimodal dense MLP, one weight set per modality: pre_norm.weight `[3*C]`;
    up_gate_proj.weight `[3*2I, C]` (per set: gate / up interleaved, even / odd rows);
    down_proj.weight `[3*C, I]`."""

    def __init__(self, config: Magi2Config, dtype: torch.dtype) -> None:
        super().__init__()
        c, i, m = config.hidden_size, config.dense_intermediate_size, config.num_modalities
        self.pre_norm = ModalityRMSNorm(m, c, config.norm_eps)
        self.up_gate_proj = ModalityLinear(m, c, 2 * i, dtype)
        self.down_proj = ModalityLinear(m, i, c, dtype)

    def forward(self, u: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """u `[T_local, C]` -> `[T_local, C]` fp32."""
        n = self.pre_norm.folded(u, plan.modality, plan.groups)
        dtype = self.down_proj.weight.dtype
        h = self.up_gate_proj(n, plan.groups, Fusion(swiglu=True, out_dtype=dtype))
        out: torch.Tensor = self.down_proj(h, plan.groups)
        return out


class MoEMLP(nn.Module):
    """MoE MLP: pre_norm (three modality sets) -> split_linear -> `MultiHeadMoE`
    (`moe_mlp`) -> merge_linear, plus the shared expert and the modality-specific shared
    expert on the normed input (SwiGLU7, even / odd interleaved fc1 rows).

    pre_norm.weight `[3*C]`; split_linear / merge_linear.weight `[C, C]`; shared_expert_fc1
    `[2Is, C]`, _fc2 `[C, Is]`; modality_specific_shared_expert_fc1 `[3*2Im, C]`, _fc2
    `[3*C, Im]`."""

    def __init__(
        self, config: Magi2Config, dtype: torch.dtype, context: ParallelContext,
        workspace: ExchangeWorkspace | None = None,
        experts: type[ExpertWeights] = Bf16Experts,
    ) -> None:
        super().__init__()
        c, m = config.hidden_size, config.num_modalities
        s, sm = config.shared_expert_intermediate_size, config.modality_shared_expert_intermediate_size
        self.dtype = dtype
        self.pre_norm = ModalityRMSNorm(m, c, config.norm_eps)
        self.split_linear = Linear(c, config.moe_hidden_size, dtype=dtype)
        self.moe_mlp = MultiHeadMoE(
            MoEConfig(
                hidden_size=config.moe_hidden_size, num_heads=config.moe_num_heads,
                num_experts=config.moe_num_experts, top_k=config.moe_top_k,
                expert_intermediate_size=config.moe_expert_intermediate_size,
                route_scale=config.moe_route_scale, dtype=dtype,
            ),
            context,
            workspace,
            experts=experts(),
        )
        self.merge_linear = Linear(config.moe_hidden_size, c, dtype=dtype)
        self.shared_expert_fc1 = Linear(c, 2 * s, dtype=dtype)
        self.shared_expert_fc2 = Linear(s, c, dtype=dtype)
        self.modality_specific_shared_expert_fc1 = ModalityLinear(m, c, 2 * sm, dtype)
        self.modality_specific_shared_expert_fc2 = ModalityLinear(m, sm, c, dtype)

    def forward(self, u: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """u `[T_local, C]` -> `[T_local, C]` fp32."""
        n = self.pre_norm.folded(u, plan.modality, plan.groups)
        act = Fusion(swiglu=True, out_dtype=self.dtype)
        z = self.split_linear(n, Fusion(out_dtype=self.dtype))
        moe = self.moe_mlp(z, plan.parallel)
        routed: torch.Tensor = self.merge_linear(moe)
        # routed + shared + modal, each sum in the next product's epilogue (same order)
        shared = self.shared_expert_fc2(self.shared_expert_fc1(n, act), Fusion(add=routed))
        h = self.modality_specific_shared_expert_fc1(n, plan.groups, act)
        out: torch.Tensor = self.modality_specific_shared_expert_fc2(h, plan.groups,
                                                                     Fusion(add=shared))
        return out


class Magi2Layer(nn.Module):
    """One layer: mHC around attention, then mHC around the MLP (dense or MoE).

    mHC parameters (fp32): mhc_alpha_{pre,post,res}_{attn,mlp} `[1]`,
    mhc_bias_{pre,post}_{attn,mlp} `[n]`, mhc_bias_res_{attn,mlp} `[n, n]`,
    mhc_phi_fused_{attn,mlp} `[V, 2n + n*n]`, mhc_norm.weight `[m*V]` (shared by both
    branches; three sets in multimodal layers)."""

    def __init__(
        self, config: Magi2Config, layer_id: int, dtype: torch.dtype, context: ParallelContext,
        workspace: ExchangeWorkspace, experts: type[ExpertWeights] = Bf16Experts,
    ) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        n, v = config.mhc_streams, config.mhc_width
        self.multimodal = layer_id in config.multimodal_layers
        sets = config.num_modalities if self.multimodal else 1
        for branch in ("attn", "mlp"):
            for kind in ("pre", "post", "res"):
                alpha = nn.Parameter(torch.full((1,), 0.01, dtype=torch.float32))
                setattr(self, f"mhc_alpha_{kind}_{branch}", alpha)
            for kind, shape in (("pre", (n,)), ("post", (n,)), ("res", (n, n))):
                setattr(self, f"mhc_bias_{kind}_{branch}",
                        nn.Parameter(torch.zeros(shape, dtype=torch.float32)))
            setattr(self, f"mhc_phi_fused_{branch}",
                    nn.Parameter(torch.zeros(v, 2 * n + n * n, dtype=torch.float32)))
        self.attention = Attention(config, dtype, sets)
        self.mlp = (
            DenseMLP(config, dtype) if self.multimodal
            else MoEMLP(config, dtype, context, workspace, experts)
        )
        self.mhc_norm = ModalityRMSNorm(sets, v, config.norm_eps)

    def _norm_weight(self, plan: ForwardPlan) -> torch.Tensor:
        w = self.mhc_norm.weight
        if not self.multimodal:
            return w
        return w.view(self.config.num_modalities, -1)[plan.modality]

    def forward(self, state: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """state `[T_local, n, C]` (model dtype) -> `[T_local, n, C]` (model dtype)."""
        cfg = self.config
        norm_weight = self._norm_weight(plan)
        for branch, fn in (("attn", self.attention), ("mlp", self.mlp)):
            mix = mhc_mix(
                state, norm_weight, getattr(self, f"mhc_phi_fused_{branch}"),
                tuple(getattr(self, f"mhc_alpha_{k}_{branch}") for k in ("pre", "post", "res")),
                tuple(getattr(self, f"mhc_bias_{k}_{branch}").reshape(-1)
                      for k in ("pre", "post", "res")),
                iters=cfg.mhc_sinkhorn_iters, eps=cfg.mhc_eps, norm_eps=cfg.norm_eps,
            )
            y = fn(mhc_input(state, mix, self.dtype), plan)
            state = mhc_update(state, mix, y.to(self.dtype), self.dtype)
        return state


class Block(nn.Module):
    """`layers`: the transformer layers (checkpoint prefix `block.layers.{i}`). The MoE
    layers run one after another and share one `ExchangeWorkspace` for their all-to-alls
    (each MoE output is consumed by its merge linear before the next MoE layer runs)."""

    def __init__(self, config: Magi2Config, dtype: torch.dtype, context: ParallelContext,
                 experts: type[ExpertWeights] = Bf16Experts):
        super().__init__()
        self.exchange_workspace = ExchangeWorkspace()
        self.layers = nn.ModuleList(
            Magi2Layer(config, i, dtype, context, self.exchange_workspace, experts)
            for i in range(config.num_layers)
        )


class Rope(nn.Module):
    """`bands` `[B]` fp32 buffer (checkpoint `pre_adapter.rope.bands`)."""

    bands: torch.Tensor

    def __init__(self, bands: int) -> None:
        super().__init__()
        self.register_buffer("bands", default_bands(bands))


class PreAdapter(nn.Module):
    """fp32 per-modality embedders `{video,text,audio}_embedder` (weight `[V, in_m]`, bias
    `[V]`; the V columns are the n streams, stream-major) and the rotary bands. `width`
    replaces V (the refiner's adapters: C, one stream)."""

    def __init__(self, config: TransformerShape, width: int | None = None) -> None:
        super().__init__()
        # only a Magi2Config has mHC streams; the refiner (one stream) passes `width`
        v = cast(Magi2Config, config).mhc_width if width is None else width
        self.video_embedder = Linear(config.video_in_channels, v, bias=True)
        self.text_embedder = Linear(config.text_in_channels, v, bias=True)
        self.audio_embedder = Linear(config.audio_in_channels, v, bias=True)
        self.rope = Rope(config.rope_bands)

    def embedders(self) -> tuple[Linear, Linear, Linear]:
        """In modality order (video, audio, text)."""
        return self.video_embedder, self.audio_embedder, self.text_embedder


class PostAdapter(nn.Module):
    """fp32 final_norm_{video,audio}.weight `[V]`, final_linear_{video,audio}.weight
    `[out, V]` (no bias); `width` replaces V."""

    def __init__(self, config: TransformerShape, width: int | None = None) -> None:
        super().__init__()
        # only a Magi2Config has mHC streams; the refiner (one stream) passes `width`
        v = cast(Magi2Config, config).mhc_width if width is None else width
        self.final_norm_video = RMSNorm(v, config.norm_eps)
        self.final_norm_audio = RMSNorm(v, config.norm_eps)
        self.final_linear_video = Linear(v, config.video_in_channels)
        self.final_linear_audio = Linear(v, config.audio_in_channels)


class Magi2Transformer(PlannedModel[ForwardPlan, PackedInputs, torch.Tensor]):
    """The MAGI-2 transformer, sharded by the given `ParallelContext`.

    `dtype` (fp32 or bf16) is the dtype of the linears and experts and of the state between
    layers; see the module docstring for the rest. `experts`: the routed experts' weight
    format (`headmoe.moe.weights.ExpertWeights`; the released `Bf16Experts` by default).
    Parameters start at zeros (identity norms); load weights with `load_checkpoint`.
    Inference only."""

    def __init__(
        self, config: Magi2Config, context: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32, experts: type[ExpertWeights] = Bf16Experts,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
        context = context if context is not None else ParallelContext.single()
        _validate_parallel(config, context.config)
        self.config, self.context, self.dtype = config, context, dtype
        self.pre_adapter = PreAdapter(config)
        self.post_adapter = PostAdapter(config)
        self.block = Block(config, dtype, context, experts)

    @property
    def out_width(self) -> int:
        """Columns of the packed output (`Magi2Config.out_width`)."""
        return self.config.out_width

    # ------------------------------------------------------------------ planning
    def plan(self, packed: PackedInputs) -> ForwardPlan:
        """Validate `packed` and compute this rank's `ForwardPlan` (host only, no
        collective). Raises `ValueError` naming the bad field."""
        packed.validate(self.config)
        ctx = self.context
        counts = sp_counts(ctx, packed.num_tokens)
        schedule = forward_schedule(self.config, ctx.topology, ctx.coords, counts)
        fields = row_plan_fields(ctx, counts, packed.modality, packed.coords,
                                 self.pre_adapter.rope.bands,
                                 self.pre_adapter.video_embedder.weight.device, schedule,
                                 schedule.moe_dispatch)
        return ForwardPlan(**fields, segments=packed.segments())

    # ------------------------------------------------------------------ forward
    def _embed(self, packed: PackedInputs, plan: ForwardPlan) -> torch.Tensor:
        """This rank's initial state `[T_local, n, C]` in the model dtype."""
        cfg = self.config
        dev = self.pre_adapter.video_embedder.weight.device
        x = packed.x[plan.lo : plan.hi].to(dev)
        out = embed_rows(self.pre_adapter.embedders(), x, plan.groups, cfg.mhc_width)
        state = out.to(self.dtype)
        state[:, : cfg.time_embed_dim] = packed.time_tokens[plan.lo : plan.hi].to(dev)
        return state.view(plan.local_tokens, cfg.mhc_streams, cfg.hidden_size)

    def _post(self, state: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """`[T_local, n, C]` -> `[T_local, out_width]` fp32 (text rows zero)."""
        h = state.reshape(plan.local_tokens, self.config.mhc_width).float()
        post = self.post_adapter
        local = h.new_zeros((plan.local_tokens, self.out_width))
        for m, norm, lin in ((VIDEO, post.final_norm_video, post.final_linear_video),
                             (AUDIO, post.final_norm_audio, post.final_linear_audio)):
            rows = plan.groups[m]
            if rows.numel():
                local[rows, : lin.weight.shape[0]] = lin(norm(h[rows]))
        return local

    def _layers(self) -> Iterable[nn.Module]:
        return self.block.layers

    def _trace_in(self, trace: dict[str, torch.Tensor], state: torch.Tensor,
                  plan: ForwardPlan) -> None:
        trace["block_in"] = state.reshape(plan.local_tokens, self.config.mhc_width).float()

    def _trace_layer(self, trace: dict[str, torch.Tensor], i: int, out: torch.Tensor,
                     plan: ForwardPlan) -> None:
        trace[f"layer{i}_out"] = out.reshape(plan.local_tokens, self.config.mhc_width).float()

    @torch.no_grad()
    def forward_packed(
        self, packed: PackedInputs, trace: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One transformer forward on packed inputs (`headmoe.models.magi2.packing`).

        packed: identical on every rank of this SP group (host tensors). Returns the full
        `[T, out_width]` fp32 prediction on every SP rank (columns 0..47 on video rows,
        0..63 on audio rows, zeros on text rows). `trace`, when given, receives this rank's
        rows (sequence order, fp32 `[T_local, V]`) of `block_in` and `layer{i}_out`. The
        collectives it issues are checked against its `forward_schedule`."""
        return self.run_planned(packed, trace)

    def forward(self, branches: Sequence[BranchInput]) -> list[BranchOutput]:
        """Velocity predictions of the CFG branches this rank's SP group runs (identical on
        every SP rank): packs them (`pack_branches`), runs `forward_packed`, unpacks.
        Returns one fp32 `BranchOutput` per branch, full tensors on every SP rank."""
        packed = pack_branches(branches, self.config)
        if self.context.config.cfg_parallel_size == 2 and len(branches) != 1:
            raise ValueError(
                f"len(branches)={len(branches)}: with cfg_parallel_size=2 each rank runs one branch"
            )
        return unpack_outputs(self.forward_packed(packed), branches, self.config)
