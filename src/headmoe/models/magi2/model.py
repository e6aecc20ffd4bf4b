"""The MAGI-2 transformer: adapters, mHC layers with Ulysses attention and head-EP MoE MLPs.

Sharding. The branches of one forward are packed as `[video | audio | text]` per branch,
one attention segment per branch, and split over the SP group with the balanced contiguous
split (`sp_token_counts`). Everything except attention and the MoE experts is token-local
and runs on this rank's contiguous shard; attention moves q, k, v to head shards with one
Ulysses all-to-all, attends per segment, and moves the output back; MoE layers exchange
over their EP group (or the SP group with replicas) inside `MultiHeadMoE`. The SP token
counts are computed once per forward on the host and handed to every exchange. At the end
every SP rank all-gathers the output shards, so each returns full outputs.

Layout independence. Every product over a layout-dependent number of rows goes through
`bi_linear` / `bi_matmul`; every position-dependent table (rotary angles, time sinusoids)
is computed per branch, identically in every layout; sums over streams run in a fixed order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from headmoe.distributed.context import ParallelContext
from headmoe.distributed.exchange import (
    ExchangeWorkspace,
    ulysses_heads_to_seq,
    ulysses_qkv_to_heads,
)
from headmoe.layers.activations import sigmoid, swiglu7
from headmoe.layers.attention import segment_attention
from headmoe.layers.linear import Linear, ModalityLinear
from headmoe.layers.mhc import mhc_input, mhc_mix, mhc_update
from headmoe.layers.norms import ModalityRMSNorm, RMSNorm
from headmoe.layers.rope import apply_rope, rope_tables
from headmoe.models.magi2.config import AUDIO, MODALITIES, VIDEO, Magi2Config
from headmoe.models.magi2.config import validate_parallel as _validate_parallel
from headmoe.moe import MoEConfig, MultiHeadMoE


@dataclass(frozen=True)
class BranchInput:
    """One CFG branch: video latents `[T_lat, H_lat, W_lat, video_in_channels]`, audio latents
    `[T_audio, audio_in_channels]`, text features `[L_text, text_in_channels]` (all fp32), and
    the diffusion times of video and audio in [0, 1] (1 = pure noise)."""

    video: torch.Tensor
    audio: torch.Tensor
    text: torch.Tensor
    t_video: float
    t_audio: float


@dataclass(frozen=True)
class BranchOutput:
    """Velocity predictions of one branch, fp32, shaped like the branch's video and audio."""

    video: torch.Tensor
    audio: torch.Tensor


def sp_token_counts(length: int, sp: int) -> tuple[int, ...]:
    """Balanced contiguous split of `length` tokens over `sp` ranks: the first `length % sp`
    ranks get one extra token. Pure arithmetic, identical on every rank."""
    base, extra = divmod(length, sp)
    return tuple(base + (1 if r < extra else 0) for r in range(sp))


def time_embedding(t: float, dim: int) -> torch.Tensor:
    """64-d (or `dim`-d) sinusoid of a diffusion time `t` in [0, 1]: `[cos(a) | sin(a)]` with
    `a_k = 1000 t * 10000^(-k / (dim/2))`; computed in float64, returned fp32 `[dim]`."""
    half = dim // 2
    arg = 1000.0 * t * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    return torch.cat([arg.cos(), arg.sin()]).float()


def branch_coords(branch: BranchInput) -> torch.Tensor:
    """Rotary coordinates `[L_branch, 3]` float64 (t, h, w) of a branch's packed tokens.

    Video: the latent grid index (t, h, w). Audio token i: t = i * T_lat / T_audio (the
    audio timeline stretched onto the video's latent frames; i when there is no video),
    h = w = 0. Text: zeros (zero angles, no rotation)."""
    t_lat, h_lat, w_lat = branch.video.shape[:3]
    grid = torch.stack(
        torch.meshgrid(
            torch.arange(t_lat), torch.arange(h_lat), torch.arange(w_lat), indexing="ij"
        ),
        dim=-1,
    ).reshape(-1, 3).double()
    n_audio = branch.audio.shape[0]
    step = t_lat / n_audio if t_lat and n_audio else 1.0
    audio = torch.zeros(n_audio, 3, dtype=torch.float64)
    audio[:, 0] = torch.arange(n_audio, dtype=torch.float64) * step
    text = torch.zeros(branch.text.shape[0], 3, dtype=torch.float64)
    return torch.cat([grid, audio, text])


@dataclass
class ForwardPlan:
    """Host-side facts of one forward on this rank, computed once and shared by all layers.

    counts: SP token counts in SP order; lo/hi: this rank's global rows; segments: each
    branch's global `(start, stop)`; pieces: `(branch, modality, start, length)` runs of the
    packed sequence; modality `[T_local]` int64; groups[m]: local rows of modality m;
    cos/sin `[T_local, 3 * rope_bands]` fp32."""

    counts: tuple[int, ...]
    lo: int
    hi: int
    segments: list[tuple[int, int]]
    pieces: list[tuple[int, int, int, int]]
    modality: torch.Tensor
    groups: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def local_tokens(self) -> int:
        return self.hi - self.lo


class Attention(nn.Module):
    """Gated attention with q/k RMSNorm, 3-D rotary, learned sinks and Ulysses SP.

    Parameters: pre_norm.weight `[C]`, linear_g.weight `[H, C]`, linear_qkv.weight
    `[3*H*D, C]` (rows q heads, then k heads, then v heads), linear_proj.weight `[C, H*D]`,
    q_norm.weight / k_norm.weight `[D]`, sinks `[1, H]` (fp32 except the linears)."""

    def __init__(self, config: Magi2Config, dtype: torch.dtype) -> None:
        super().__init__()
        c, h, d = config.hidden_size, config.num_attention_heads, config.head_dim
        self.heads, self.head_dim, self.dtype, self.eps = h, d, dtype, config.norm_eps
        self.pre_norm = RMSNorm(c, config.norm_eps)
        self.linear_g = Linear(c, h, dtype=dtype)
        self.linear_qkv = Linear(c, 3 * h * d, dtype=dtype)
        self.linear_proj = Linear(h * d, c, dtype=dtype)
        self.q_norm = RMSNorm(d, config.norm_eps)
        self.k_norm = RMSNorm(d, config.norm_eps)
        self.sinks = nn.Parameter(torch.zeros(1, h, dtype=torch.float32))

    def forward(self, u: torch.Tensor, plan: ForwardPlan, ctx: ParallelContext) -> torch.Tensor:
        """u `[T_local, C]` fp32 -> `[T_local, C]` fp32."""
        t = u.shape[0]
        x = self.pre_norm(u)
        gate = self.linear_g(x)
        qkv = self.linear_qkv(x).view(t, 3, self.heads, self.head_dim)
        q = apply_rope(self.q_norm(qkv[:, 0]), plan.cos, plan.sin)
        k = apply_rope(self.k_norm(qkv[:, 1]), plan.cos, plan.sin)
        qkv = torch.stack([q, k, qkv[:, 2]], dim=1).to(self.dtype)
        sp = ctx.config.ulysses_degree
        local = self.heads // sp
        if sp > 1:
            qkv = ulysses_qkv_to_heads(qkv, ctx.group("sp"), plan.counts, counters=ctx.counters)
        first = ctx.coords.sp * local
        sinks = self.sinks[0, first : first + local]
        o = segment_attention(qkv, plan.segments, sinks, 1.0 / math.sqrt(self.head_dim))
        if sp > 1:
            o = ulysses_heads_to_seq(o, ctx.group("sp"), plan.counts, counters=ctx.counters)
        o = o.float() * sigmoid(gate)[:, :, None]
        return self.linear_proj(o.reshape(t, self.heads * self.head_dim))


class DenseMLP(nn.Module):
    """Multimodal dense MLP: modality RMSNorm -> up_gate_proj -> SwiGLU7 -> down_proj, all
    modality-specific. pre_norm.weight `[3*C]` fp32; up_gate_proj.weight `[3*2*I, C]` (per
    modality: gate rows then up rows); down_proj.weight `[3*C, I]`."""

    def __init__(self, config: Magi2Config, dtype: torch.dtype) -> None:
        super().__init__()
        c, i, m = config.hidden_size, config.dense_intermediate_size, config.num_modalities
        self.config = config
        self.pre_norm = ModalityRMSNorm(m, c, config.norm_eps)
        self.up_gate_proj = ModalityLinear(m, c, 2 * i, dtype)
        self.down_proj = ModalityLinear(m, i, c, dtype)

    def forward(self, u: torch.Tensor, plan: ForwardPlan, ctx: ParallelContext) -> torch.Tensor:
        """u `[T_local, C]` fp32 -> `[T_local, C]` fp32."""
        n = self.pre_norm(u, plan.modality)
        act = swiglu7(self.up_gate_proj(n, plan.groups), self.config.swiglu_limit,
                      self.config.swiglu_alpha)
        return self.down_proj(act, plan.groups)


class MoEMLP(nn.Module):
    """MoE MLP: modality RMSNorm; split_linear -> `MultiHeadMoE` (`moe_mlp`) -> merge_linear;
    plus a shared expert and a modality-specific shared expert (SwiGLU7) on the normed input.

    pre_norm.weight `[3*C]`; split_linear.weight `[Hm*dm, C]`; merge_linear.weight
    `[C, Hm*dm]`; shared_expert_fc1 `[2*Is, C]`, shared_expert_fc2 `[C, Is]`;
    modality_specific_shared_expert_fc1 `[3*2*Is, C]`, ..._fc2 `[3*C, Is]`."""

    def __init__(
        self, config: Magi2Config, dtype: torch.dtype, context: ParallelContext,
        workspace: ExchangeWorkspace | None = None,
    ) -> None:
        super().__init__()
        c, m, s = config.hidden_size, config.num_modalities, config.shared_expert_intermediate_size
        self.config, self.dtype = config, dtype
        self.pre_norm = ModalityRMSNorm(m, c, config.norm_eps)
        self.split_linear = Linear(c, config.moe_hidden_size, dtype=dtype)
        self.merge_linear = Linear(config.moe_hidden_size, c, dtype=dtype)
        self.shared_expert_fc1 = Linear(c, 2 * s, dtype=dtype)
        self.shared_expert_fc2 = Linear(s, c, dtype=dtype)
        self.modality_specific_shared_expert_fc1 = ModalityLinear(m, c, 2 * s, dtype)
        self.modality_specific_shared_expert_fc2 = ModalityLinear(m, s, c, dtype)
        self.moe_mlp = MultiHeadMoE(
            MoEConfig(
                hidden_size=config.moe_hidden_size, num_heads=config.moe_num_heads,
                num_experts=config.moe_num_experts, top_k=config.moe_top_k,
                expert_intermediate_size=config.moe_expert_intermediate_size,
                route_scale=config.moe_route_scale, dtype=dtype,
            ),
            context,
            workspace,
        )

    def forward(self, u: torch.Tensor, plan: ForwardPlan, ctx: ParallelContext) -> torch.Tensor:
        """u `[T_local, C]` fp32 -> `[T_local, C]` fp32."""
        lim, alpha = self.config.swiglu_limit, self.config.swiglu_alpha
        n = self.pre_norm(u, plan.modality)
        z = self.split_linear(n).to(self.dtype)
        routed = self.merge_linear(self.moe_mlp(z, token_counts=plan.counts))
        shared = self.shared_expert_fc2(swiglu7(self.shared_expert_fc1(n), lim, alpha))
        h = self.modality_specific_shared_expert_fc1(n, plan.groups)
        modal = self.modality_specific_shared_expert_fc2(swiglu7(h, lim, alpha), plan.groups)
        return routed + shared + modal


class Magi2Layer(nn.Module):
    """One layer: mHC around attention, then mHC around the MLP (dense or MoE).

    mHC parameters (fp32): mhc_alpha_{pre,post,res}_{attn,mlp} `[1]`,
    mhc_bias_{pre,post}_{attn,mlp} `[n]`, mhc_bias_res_{attn,mlp} `[n*n]`,
    mhc_phi_fused_{attn,mlp} `[n*C, 2n + n*n]`, mhc_norm.weight `[n*C]` (shared by both
    branches)."""

    def __init__(
        self, config: Magi2Config, layer_id: int, dtype: torch.dtype, context: ParallelContext,
        workspace: ExchangeWorkspace,
    ) -> None:
        super().__init__()
        self.config = config
        n, c = config.mhc_streams, config.hidden_size
        self.attention = Attention(config, dtype)
        self.mlp = (
            DenseMLP(config, dtype) if layer_id in config.dense_layers
            else MoEMLP(config, dtype, context, workspace)
        )
        for branch in ("attn", "mlp"):
            for kind, size in (("pre", n), ("post", n), ("res", n * n)):
                alpha = nn.Parameter(torch.full((1,), 0.01, dtype=torch.float32))
                setattr(self, f"mhc_alpha_{kind}_{branch}", alpha)
                setattr(self, f"mhc_bias_{kind}_{branch}",
                        nn.Parameter(torch.zeros(size, dtype=torch.float32)))
            setattr(self, f"mhc_phi_fused_{branch}",
                    nn.Parameter(torch.zeros(n * c, 2 * n + n * n, dtype=torch.float32)))
        self.mhc_norm = RMSNorm(n * c, config.norm_eps)

    def forward(
        self, state: torch.Tensor, plan: ForwardPlan, ctx: ParallelContext
    ) -> torch.Tensor:
        """state `[T_local, n, C]` fp32 -> `[T_local, n, C]` fp32."""
        cfg = self.config
        for branch, fn in (("attn", self.attention), ("mlp", self.mlp)):
            mix = mhc_mix(
                state, self.mhc_norm.weight, getattr(self, f"mhc_phi_fused_{branch}"),
                tuple(getattr(self, f"mhc_alpha_{k}_{branch}") for k in ("pre", "post", "res")),
                tuple(getattr(self, f"mhc_bias_{k}_{branch}") for k in ("pre", "post", "res")),
                iters=cfg.mhc_sinkhorn_iters, eps=cfg.mhc_eps, norm_eps=cfg.norm_eps,
            )
            state = mhc_update(state, mix, fn(mhc_input(state, mix), plan, ctx))
        return state


class Block(nn.Module):
    """`layers`: the transformer layers (checkpoint prefix `block.layers.{i}`). The MoE
    layers run one after another and share one `ExchangeWorkspace` for their all-to-alls
    (each MoE output is consumed by its merge linear before the next MoE layer runs)."""

    def __init__(self, config: Magi2Config, dtype: torch.dtype, context: ParallelContext):
        super().__init__()
        self.exchange_workspace = ExchangeWorkspace()
        self.layers = nn.ModuleList(
            Magi2Layer(config, i, dtype, context, self.exchange_workspace)
            for i in range(config.num_layers)
        )


class PreAdapter(nn.Module):
    """fp32 per-modality embedders `{video,audio,text}_embedder` (weight `[C, in]`, bias `[C]`)."""

    def __init__(self, config: Magi2Config) -> None:
        super().__init__()
        c = config.hidden_size
        self.video_embedder = Linear(config.video_in_channels, c, bias=True)
        self.audio_embedder = Linear(config.audio_in_channels, c, bias=True)
        self.text_embedder = Linear(config.text_in_channels, c, bias=True)

    def embedders(self) -> tuple[Linear, Linear, Linear]:
        """In modality order (video, audio, text)."""
        return self.video_embedder, self.audio_embedder, self.text_embedder


class PostAdapter(nn.Module):
    """fp32 final_norm_{video,audio} `[C]` and final_linear_{video,audio} `[out, C]`."""

    def __init__(self, config: Magi2Config) -> None:
        super().__init__()
        c = config.hidden_size
        self.final_norm_video = RMSNorm(c, config.norm_eps)
        self.final_norm_audio = RMSNorm(c, config.norm_eps)
        self.final_linear_video = Linear(c, config.video_in_channels)
        self.final_linear_audio = Linear(c, config.audio_in_channels)


class Magi2Transformer(nn.Module):
    """MAGI-2-family diffusion transformer, sharded by the given `ParallelContext`.

    `dtype` (fp32 or bf16) is the dtype of the linears and experts; norms, router gate,
    biases, mHC parameters, adapters and sinks are fp32; residual streams accumulate in fp32.
    Parameters start at zeros (identity norms); load weights with `load_checkpoint`."""

    expert_parallel_style = "head"

    def __init__(
        self, config: Magi2Config, context: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
        context = context if context is not None else ParallelContext.single()
        _validate_parallel(config, context.config)
        self.config, self.context, self.dtype = config, context, dtype
        self.pre_adapter = PreAdapter(config)
        self.block = Block(config, dtype, context)
        self.post_adapter = PostAdapter(config)

    # ------------------------------------------------------------------ planning
    def _check_inputs(self, branches: Sequence[BranchInput]) -> None:
        cfg, cfg_size = self.config, self.context.config.cfg_parallel_size
        if not isinstance(branches, Sequence) or not branches:
            raise ValueError(f"branches must be a non-empty sequence, got {branches!r}")
        if cfg_size == 2 and len(branches) != 1:
            raise ValueError(
                f"len(branches)={len(branches)}: with cfg_parallel_size=2 each rank runs one branch"
            )
        for b, br in enumerate(branches):
            if not isinstance(br, BranchInput):
                raise ValueError(f"branches[{b}] must be a BranchInput, got {type(br).__name__}")
            for name, ndim, ch in (("video", 4, cfg.video_in_channels),
                                   ("audio", 2, cfg.audio_in_channels),
                                   ("text", 2, cfg.text_in_channels)):
                x = getattr(br, name)
                if not isinstance(x, torch.Tensor) or x.dim() != ndim or x.shape[-1] != ch \
                        or x.dtype != torch.float32:
                    got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                    raise ValueError(
                        f"branches[{b}].{name} must be an fp32 tensor of {ndim} dims with "
                        f"{ch} channels last, got {got!r}"
                    )
            for name in ("t_video", "t_audio"):
                t = getattr(br, name)
                if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t <= 1.0:
                    raise ValueError(f"branches[{b}].{name} must be a float in [0, 1], got {t!r}")
        if sum(self._branch_lengths(br) for br in branches) == 0:
            raise ValueError("branches hold no tokens (video, audio and text all empty)")

    @staticmethod
    def _branch_lengths(br: BranchInput) -> int:
        return br.video.shape[:3].numel() + br.audio.shape[0] + br.text.shape[0]

    def plan(self, branches: Sequence[BranchInput]) -> ForwardPlan:
        """Validate the inputs and compute this rank's `ForwardPlan` (host only, no
        collective). Raises `ValueError` naming the bad field."""
        self._check_inputs(branches)
        ctx = self.context
        segments, pieces, coords, start = [], [], [], 0
        for b, br in enumerate(branches):
            seg_start = start
            for m, n in enumerate((br.video.shape[:3].numel(), br.audio.shape[0],
                                   br.text.shape[0])):
                pieces.append((b, m, start, n))
                start += n
            segments.append((seg_start, start))
            coords.append(rope_tables(branch_coords(br), self.config.rope_bands,
                                      self.config.rope_theta, self.config.rope_axis_scales))
        counts = sp_token_counts(start, ctx.config.ulysses_degree)
        lo = sum(counts[: ctx.coords.sp])
        hi = lo + counts[ctx.coords.sp]
        modality = torch.empty(start, dtype=torch.int64)
        for _, m, s, n in pieces:
            modality[s : s + n] = m
        modality = modality[lo:hi]
        groups = [torch.nonzero(modality == m).flatten() for m in range(len(MODALITIES))]
        dev = self.pre_adapter.video_embedder.weight.device
        cos = torch.cat([c for c, _ in coords])[lo:hi].to(dev)
        sin = torch.cat([s for _, s in coords])[lo:hi].to(dev)
        return ForwardPlan(counts, lo, hi, segments, pieces, modality.to(dev),
                           [g.to(dev) for g in groups], cos, sin)

    # ------------------------------------------------------------------ forward
    def _embed(self, branches: Sequence[BranchInput], plan: ForwardPlan) -> torch.Tensor:
        dev = self.pre_adapter.video_embedder.weight.device
        out = torch.zeros(plan.local_tokens, self.config.hidden_size, device=dev)
        embedders = self.pre_adapter.embedders()
        tdim = self.config.time_embed_dim
        for b, m, s, n in plan.pieces:
            a, e = max(s, plan.lo), min(s + n, plan.hi)
            if e <= a:
                continue
            br = branches[b]
            src = (br.video.reshape(-1, br.video.shape[-1]), br.audio, br.text)[m]
            emb = embedders[m](src[a - s : e - s].to(dev))
            t = (br.t_video, br.t_audio, 0.0)[m]
            emb[:, :tdim] = time_embedding(float(t), tdim).to(dev)
            out[a - plan.lo : e - plan.lo] = emb
        return out

    def _gather(self, local: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """Every SP rank's `[count_r, P]` rows -> the full `[L, P]` (all_gather of padded
        shards over the SP group)."""
        sp = self.context.config.ulysses_degree
        if sp == 1:
            return local
        width, rows = local.shape[1], max(plan.counts)
        padded = local.new_zeros((rows, width))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(sp)]
        dist.all_gather(parts, padded, group=self.context.group("sp"))
        moved = (sp - 1) * padded.numel() * padded.element_size()
        self.context.counters.record_exchange("sp_output_gather", moved, moved)
        return torch.cat([p[:c] for p, c in zip(parts, plan.counts)])

    @torch.no_grad()
    def forward(self, branches: Sequence[BranchInput]) -> list[BranchOutput]:
        """Velocity predictions of the packed branches (see the module docstring).

        branches: the `BranchInput`s this rank's SP group runs (identical on every SP rank).
        Returns one fp32 `BranchOutput` per branch, full tensors on every SP rank."""
        cfg, ctx = self.config, self.context
        plan = self.plan(branches)
        x = self._embed(branches, plan)
        n = cfg.mhc_streams
        state = x[:, None, :].expand(-1, n, -1).contiguous()
        for layer in self.block.layers:
            state = layer(state, plan, ctx)
        h = state[:, 0]
        for i in range(1, n):
            h = h + state[:, i]
        h = h * (1.0 / n)
        post = self.post_adapter
        width = max(cfg.video_in_channels, cfg.audio_in_channels)
        local = h.new_zeros((plan.local_tokens, width))
        for m, norm, lin in ((VIDEO, post.final_norm_video, post.final_linear_video),
                             (AUDIO, post.final_norm_audio, post.final_linear_audio)):
            rows = plan.groups[m]
            if rows.numel():
                local[rows, : lin.weight.shape[0]] = lin(norm(h[rows]))
        full = self._gather(local, plan)
        outs = []
        for b, br in enumerate(branches):
            (_, _, vs, vn), (_, _, as_, an) = plan.pieces[3 * b + VIDEO], plan.pieces[3 * b + AUDIO]
            video = full[vs : vs + vn, : cfg.video_in_channels].reshape(br.video.shape)
            audio = full[as_ : as_ + an, : cfg.audio_in_channels].reshape(br.audio.shape)
            outs.append(BranchOutput(video.contiguous(), audio.contiguous()))
        return outs
