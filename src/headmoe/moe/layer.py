"""`MultiHeadMoE`: the multi-head MoE layer with head-sharded expert parallelism.

Forward on one rank: view `[T, H*d]` as `[T, H, d]`, route every (token, head) among the
head's experts, run the experts, combine. With EP (an SP group of more than one rank) the
heads are padded to `ceil(H/E)*E`, scattered to their owners with one all-to-all, computed
there for every token of the dispatch group, and gathered back with a second all-to-all.
See docs/moe.md for the maths, the dispatch modes and the "auto" rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.exchange import (
    ExchangeWorkspace,
    HeadLayout,
    gather_heads,
    scatter_heads,
)
from headmoe.distributed.forward_plan import (
    HeadDispatch,
    ParallelPlan,
    check_sp_counts,
    one_rank_plan,
    parallel_plan,
)
from headmoe.distributed.sharding import (
    DispatchPlan,
    HeadShard,
    dispatch_plan,
    head_shard,
)
from headmoe.distributed.topology import Coords
from headmoe.moe import triton_moe
from headmoe.moe.checkpoint import fit_rows, row_tensors
from headmoe.moe.config import MoEConfig
from headmoe.moe.experts import experts_grouped
from headmoe.moe.routing import route
from headmoe.moe.weights import Bf16Experts, ExpertWeights

#: the expert paths shipped here are batch-invariant (tests/moe/test_experts.py)
EXPERTS_BATCH_INVARIANT = True


def plan_dispatch(
    mode: str, sp_counts: tuple[int, ...], sp_rank: int, ep_size: int, batch_invariant: bool
) -> tuple[str, HeadLayout]:
    """`(group axis, layout)` of one MoE exchange: `headmoe.distributed.sharding.
    dispatch_plan` (the rule) as the exchange's `HeadLayout`."""
    p = dispatch_plan(mode, sp_counts, sp_rank, ep_size, batch_invariant)
    return p.axis, p.layout


def moe_dispatch(parallel: ParallelConfig, coords: Coords, ep_size: int,
                 counts: tuple[int, ...]) -> DispatchPlan:
    """The MoE exchange of one forward on the rank at `coords` whose SP group splits the
    tokens as `counts` (SP order): `dispatch_plan` of the configured `moe_exchange` for the
    experts shipped here (`EXPERTS_BATCH_INVARIANT`). Models' schedules and the planner call
    it."""
    return dispatch_plan(parallel.moe_exchange, counts, coords.sp, ep_size,
                         EXPERTS_BATCH_INVARIANT)


def moe_plan(ctx: ParallelContext, counts: tuple[int, ...]) -> ParallelPlan:
    """The `ParallelPlan` of a forward of MoE layers alone (no model around them) under
    `ctx` for SP token counts `counts` (`ValueError` naming `token_counts` first)."""
    counts = check_sp_counts(ctx.config.ulysses_degree, counts)
    dispatch = moe_dispatch(ctx.config, ctx.coords, ctx.topology.expert_parallel_size, counts)
    return parallel_plan(ctx, counts, dispatch)


class MoERouter(nn.Module):
    """Holds the router biases: `expert_bias` (selection) and `expert_bias_ema`, `[rows]`
    fp32, rows ordered (head, expert)."""

    def __init__(self, rows: int):
        super().__init__()
        self.expert_bias: torch.Tensor
        self.expert_bias_ema: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(rows))
        self.register_buffer("expert_bias_ema", torch.zeros(rows))


class MultiHeadMoE(nn.Module):
    """Multi-head MoE layer (MAGI-2 semantics), head-sharded over the EP degree of `context`.

    Parameters (checkpoint names, rows ordered (head, expert), this EP rank's `h*E` rows with
    `h = ceil(H/E_ep)`; rows of padded heads are zeros): `gate` `[h*E, d]` fp32; the routed
    experts' tensors of `experts` (an `ExpertWeights` format, default `Bf16Experts`: `W_gate`,
    `W_up` `[h*E, d, d_expert]` and `W_down` `[h*E, d_expert, d]` in `config.dtype`);
    `router.expert_bias`, `router.expert_bias_ema` `[h*E]` fp32. `load_state_dict` accepts
    full (unsharded) or local-shaped tensors; with `config.bias_from_ema` the loaded
    `expert_bias_ema` also becomes `expert_bias`. Inference only (no gradients).

    `context` is read at construction only (which head shard this rank holds); each forward
    receives its `ParallelPlan`.

    `workspace`: an optional `ExchangeWorkspace` for both all-to-alls, typically one shared
    by every MoE layer of a model (layers run one after the other). With it, the output of
    `forward` may alias the workspace: it stays valid until the next `forward` of a layer
    sharing that workspace, so consume it (e.g. with the merge linear) before then.
    Without it every call allocates fresh buffers.
    """

    def __init__(
        self,
        config: MoEConfig,
        context: ParallelContext | None = None,
        workspace: ExchangeWorkspace | None = None,
        shard: HeadShard | None = None,
        experts: ExpertWeights | None = None,
    ):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.workspace = workspace
        self.shard = self._checked_shard(context, shard)
        self.ep_size = self.shard.ep_size
        self.row_start, self.row_stop, rows = self.shard.rows(config.num_experts)
        e, d, f = config.num_experts, config.head_dim, config.expert_intermediate_size
        self.local_heads = rows // e
        self.real_heads = (self.row_stop - self.row_start) // e
        self.gate = nn.Parameter(torch.zeros(rows, d), requires_grad=False)
        self.experts = Bf16Experts() if experts is None else experts
        self.experts.register(self, rows, d, f, config.dtype)
        self.row_tensors = row_tensors(self.experts.NAMES)
        """Names of this layer's tensors with (head, expert) rows (sliced per EP rank)."""
        self.router = MoERouter(rows)
        self.expert_compute = experts_grouped
        """`(z, experts, weights, W_gate, W_up, W_down) -> y`; `experts_reference` also fits."""

    def _checked_shard(self, context: ParallelContext | None, shard: HeadShard | None
                       ) -> HeadShard:
        """The head shard whose weights this layer holds (`shard`, default the context's),
        checked once against the shard its exchanges deliver to this rank."""
        heads = self.config.num_heads
        if context is None:
            own = shard or head_shard(heads, 1, 0)
            delivered = head_shard(heads, 1, 0)
        else:
            topo = context.topology
            e = topo.expert_parallel_size
            own = shard or head_shard(heads, e, context.coords.ep)
            plan = dispatch_plan(context.config.moe_exchange, (1,) * topo.sp, context.coords.sp,
                                 e, EXPERTS_BATCH_INVARIANT)
            delivered = head_shard(heads, e, plan.delivered_shard)
        if own != delivered:
            raise ValueError(
                f"MoE weights would hold {own.describe()}, but this rank's exchanges deliver "
                f"{delivered.describe()}"
            )
        return own

    # ------------------------------------------------------------------ checkpoint
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        full = self.config.num_heads * self.config.num_experts
        local = self.local_heads * self.config.num_experts
        for name in self.row_tensors:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = fit_rows(
                    key, state_dict[key], self.row_start, self.row_stop, local, full
                )
        bias = prefix + "router.expert_bias"
        source = prefix + self.source_name("router.expert_bias")
        if source != bias and source in state_dict:
            state_dict[bias] = state_dict[source]
        super()._load_from_state_dict(state_dict, prefix, *args)

    def source_name(self, name: str) -> str:
        """The checkpoint tensor (name relative to this module) whose values the local
        tensor `name` takes: itself, except `router.expert_bias`, which takes
        `router.expert_bias_ema` with `config.bias_from_ema`."""
        if name == "router.expert_bias" and self.config.bias_from_ema:
            return "router.expert_bias_ema"
        return name

    # ------------------------------------------------------------------ compute
    def compute_heads(self, z: torch.Tensor) -> torch.Tensor:
        """Experts of this rank's real heads for the rows it owns.

        z: `[N, real_heads, d]` in `config.dtype`; returns `[N, real_heads, d]`, same dtype."""
        rows = self.real_heads * self.config.num_experts
        triton = self.experts.uses_triton(self, z, self.expert_compute)  # docs/moe.md section 3
        route_fn = triton_moe.route_triton if triton else route
        experts, weights = route_fn(
            z, self.gate[:rows], self.router.expert_bias[:rows], self.config.top_k,
            self.config.route_scale,
        )
        return self.experts.compute(self, z, experts, weights, rows, self.expert_compute, triton)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, plan: ParallelPlan | None = None) -> torch.Tensor:
        """x: `[T_local, hidden_size]` in `config.dtype` -> `[T_local, hidden_size]`, same dtype.

        plan: this forward's `ParallelPlan` (SP token counts, the head dispatcher, the
        counters); None: one rank, nothing recorded. Pad -> dispatch -> experts -> combine:
        with an SP group the only collectives are the dispatcher's two all-to-alls. Bad
        input raises `ValueError` before any collective."""
        cfg = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != cfg.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [T, {cfg.hidden_size}], got {shape}")
        if x.dtype != cfg.dtype:
            raise ValueError(f"x.dtype must be config.dtype={cfg.dtype}, got {x.dtype}")
        t = x.shape[0]
        plan = one_rank_plan(t) if plan is None else plan
        plan.check_tokens(t)
        z = x.reshape(t, cfg.num_heads, cfg.head_dim)
        if plan.sp_group is None:  # one SP rank: every head is here
            out = self.compute_heads(z) if t else z
            plan.counters.record_moe_rows(t * cfg.num_heads)
            return out.reshape(t, cfg.hidden_size)
        if plan.dispatch is None:
            raise ValueError("plan.dispatch is None: an SP group needs the MoE head dispatcher")
        owned = self._dispatch(self._pad(z), plan.dispatch, plan)
        y = self._experts(owned, plan.dispatch.layout, plan)
        out = gather_heads(y, plan.dispatch.group, plan.dispatch.layout, workspace=self.workspace,
                           counters=plan.counters)
        return out[:, : cfg.num_heads].reshape(t, cfg.hidden_size)

    def _pad(self, z: torch.Tensor) -> torch.Tensor:
        """`[T, H, d]` -> `[T, h*E_ep, d]`: zero heads so that every EP rank owns
        `local_heads`."""
        padded = self.local_heads * self.ep_size
        if padded == z.shape[1]:
            return z
        return torch.cat([z, z.new_zeros((z.shape[0], padded - z.shape[1], z.shape[2]))], dim=1)

    def _dispatch(self, z: torch.Tensor, dispatch: HeadDispatch, plan: ParallelPlan
                  ) -> torch.Tensor:
        """Padded `[T, h*E_ep, d]` -> this rank's heads `[owned_tokens, h, d]`."""
        return scatter_heads(z, dispatch.group, dispatch.layout, workspace=self.workspace,
                             counters=plan.counters)

    def _experts(self, owned: torch.Tensor, layout: HeadLayout, plan: ParallelPlan
                 ) -> torch.Tensor:
        """The experts of this rank's real heads on `owned` `[owned_tokens, h, d]`."""
        # Padded heads arrive as zeros, which is also their output: a padding-only owner
        # returns what it received, a mixed owner overwrites only its real heads (`owned` is
        # a fresh tensor or scatter's workspace buffer, never `x`, since padding means a cat).
        y = owned
        if self.real_heads and layout.owned_tokens:
            res = self.compute_heads(owned[:, : self.real_heads])
            if self.real_heads == self.local_heads:
                y = res
            else:
                y[:, : self.real_heads] = res
        plan.counters.record_moe_rows(layout.owned_tokens * self.real_heads)
        return y
