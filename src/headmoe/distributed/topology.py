"""Rank groups as pure arithmetic (no torch.distributed).

Notation
--------
    TP, SP, CFG, DP   degrees of the tensor, sequence (Ulysses), CFG and data axes
    E                 expert-parallel degree; R = SP / E replicas (head style)
    rank = tp + TP * (sp + SP * (cfg + CFG * dp))        TP innermost, DP outermost

Axis groups (`Topology.groups(axis)`): all ranks that differ only in that axis's coordinate,
in increasing coordinate order. Head-style EP groups are runs of E consecutive SP
coordinates inside one SP group (same tp, cfg, dp); standard-style EP is one group of the
whole world. See docs/parallelism.md for worked tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from headmoe.config import ParallelConfig, check_positive_int, is_int
from headmoe.distributed.sharding import ep_coords

AXES: tuple[str, ...] = ("tp", "sp", "cfg", "dp", "ep")


@dataclass(frozen=True)
class Coords:
    """One rank's coordinates. `ep` is the rank's index inside its EP group, `ep_run` the
    index of its EP run inside its SP group (head style; 0 for standard style)."""

    tp: int
    sp: int
    cfg: int
    dp: int
    ep: int
    ep_run: int


@dataclass(frozen=True)
class Topology:
    """Validated rank layout of one job. Build with `plan_topology`."""

    world_size: int
    config: ParallelConfig
    expert_parallel_style: str
    expert_parallel_size: int
    """Resolved EP degree (head style: divides SP; standard: world size, or 1 with EP off)."""

    @property
    def tp(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def sp(self) -> int:
        return self.config.ulysses_degree

    @property
    def cfg(self) -> int:
        return self.config.cfg_parallel_size

    @property
    def dp(self) -> int:
        return self.config.data_parallel_size

    @property
    def ep_replicas(self) -> int:
        """R = SP / EP for the head style (1 for the standard style)."""
        if self.expert_parallel_style == "head":
            return self.sp // self.expert_parallel_size
        return 1

    def rank_of(self, tp: int, sp: int, cfg: int, dp: int) -> int:
        return tp + self.tp * (sp + self.sp * (cfg + self.cfg * dp))

    def coords(self, rank: int) -> Coords:
        """Coordinates of `rank`; raises `ValueError` for a rank outside the world."""
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        tp = rank % self.tp
        rest = rank // self.tp
        sp = rest % self.sp
        rest //= self.sp
        cfg = rest % self.cfg
        dp = rest // self.cfg
        if self.expert_parallel_style == "head":
            ep, ep_run = ep_coords(sp, self.expert_parallel_size)
        else:
            ep, ep_run = (rank if self.expert_parallel_size > 1 else 0), 0
        return Coords(tp=tp, sp=sp, cfg=cfg, dp=dp, ep=ep, ep_run=ep_run)

    @cached_property
    def _groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        out: dict[str, list[tuple[int, ...]]] = {a: [] for a in AXES}
        tp_, sp_, cfg_, dp_ = self.tp, self.sp, self.cfg, self.dp
        for dp in range(dp_):
            for cfg in range(cfg_):
                for sp in range(sp_):
                    out["tp"].append(tuple(self.rank_of(t, sp, cfg, dp) for t in range(tp_)))
        for dp in range(dp_):
            for cfg in range(cfg_):
                for tp in range(tp_):
                    out["sp"].append(tuple(self.rank_of(tp, s, cfg, dp) for s in range(sp_)))
        for dp in range(dp_):
            for sp in range(sp_):
                for tp in range(tp_):
                    out["cfg"].append(tuple(self.rank_of(tp, sp, c, dp) for c in range(cfg_)))
        for cfg in range(cfg_):
            for sp in range(sp_):
                for tp in range(tp_):
                    out["dp"].append(tuple(self.rank_of(tp, sp, cfg, d) for d in range(dp_)))
        if self.expert_parallel_style == "head":
            e = self.expert_parallel_size
            for sp_group in out["sp"]:
                for run in range(sp_ // e):
                    out["ep"].append(sp_group[run * e : (run + 1) * e])
        elif self.expert_parallel_size > 1:
            out["ep"].append(tuple(range(self.world_size)))
        else:
            out["ep"] = [(r,) for r in range(self.world_size)]
        return {a: tuple(sorted(g, key=lambda grp: grp[0])) for a, g in out.items()}

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis` ("tp", "sp", "cfg", "dp", "ep"): rank lists in group-rank
        order, the lists ordered by their first rank. Together they partition the world."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        return [list(g) for g in self._groups[axis]]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group of `axis` that contains `rank`."""
        self.coords(rank)
        for g in self._groups[axis] if axis in AXES else ():
            if rank in g:
                return list(g)
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")


def plan_topology(
    world_size: int, config: ParallelConfig, expert_parallel_style: str = "head"
) -> Topology:
    """Validate `config` for a world of `world_size` ranks and a model of
    `expert_parallel_style` ("head" or "standard"); return the rank layout.

    Raises `ValueError` (naming the field and value) for a world size that does not equal
    `config.world_size`, and for EP settings the style forbids. Pure arithmetic: call it
    before creating any process group.
    """
    check_positive_int("world_size", world_size)
    ep = config.resolved_expert_parallel_size(expert_parallel_style)
    if world_size != config.world_size:
        raise ValueError(
            f"world_size={world_size!r} does not equal the config's TP x SP x CFG x DP = "
            f"{config.tensor_parallel_size} x {config.ulysses_degree} x "
            f"{config.cfg_parallel_size} x {config.data_parallel_size} = {config.world_size}"
        )
    return Topology(
        world_size=world_size,
        config=config,
        expert_parallel_style=expert_parallel_style,
        expert_parallel_size=ep,
    )
