"""Rank groups as pure arithmetic (no torch.distributed).

Notation
--------
    SP, CFG, DP       degrees of the sequence (Ulysses), CFG and data axes
    E                 expert-parallel degree (divides SP); R = SP / E replicas
    rank = sp + SP * (cfg + CFG * dp)        SP innermost, DP outermost

Axis groups (`Topology.groups(axis)`): all ranks that differ only in that axis's coordinate,
in increasing coordinate order. EP groups are runs of E consecutive SP coordinates inside
one SP group (same cfg, dp; `headmoe.distributed.sharding.ep_coords`). See
docs/parallelism.md for worked tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from headmoe.config import ParallelConfig, check_positive_int, is_int
from headmoe.distributed.sharding import ep_coords

AXES: tuple[str, ...] = ("sp", "cfg", "dp", "ep")


@dataclass(frozen=True)
class Coords:
    """One rank's coordinates. `ep` is the rank's index inside its EP group, `ep_run` the
    index of its EP run inside its SP group."""

    sp: int
    cfg: int
    dp: int
    ep: int
    ep_run: int


def is_output_coords(coords: Coords) -> bool:
    """The writer of its DP group: the rank at SP and CFG coordinates 0 (the one home of
    this rule: the job, the release's placement of the decoders and the planner ask it)."""
    return (coords.sp, coords.cfg) == (0, 0)


@dataclass(frozen=True)
class Topology:
    """Validated rank layout of one job. Build with `plan_topology`."""

    world_size: int
    config: ParallelConfig
    expert_parallel_size: int
    """Resolved EP degree (divides SP)."""

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
        """R = SP / EP."""
        return self.sp // self.expert_parallel_size

    def rank_of(self, sp: int, cfg: int, dp: int) -> int:
        return sp + self.sp * (cfg + self.cfg * dp)

    def coords(self, rank: int) -> Coords:
        """Coordinates of `rank`; raises `ValueError` for a rank outside the world."""
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        sp, rest = rank % self.sp, rank // self.sp
        cfg, dp = rest % self.cfg, rest // self.cfg
        ep, ep_run = ep_coords(sp, self.expert_parallel_size)
        return Coords(sp=sp, cfg=cfg, dp=dp, ep=ep, ep_run=ep_run)

    @cached_property
    def _groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        sp_, cfg_, dp_ = self.sp, self.cfg, self.dp
        cells = [(c, d) for d in range(dp_) for c in range(cfg_)]
        out: dict[str, list[tuple[int, ...]]] = {
            "sp": [tuple(self.rank_of(s, c, d) for s in range(sp_)) for c, d in cells],
            "cfg": [tuple(self.rank_of(s, c, d) for c in range(cfg_))
                    for d in range(dp_) for s in range(sp_)],
            "dp": [tuple(self.rank_of(s, c, d) for d in range(dp_))
                   for c in range(cfg_) for s in range(sp_)],
        }
        e = self.expert_parallel_size
        out["ep"] = [g[r * e : (r + 1) * e] for g in out["sp"] for r in range(sp_ // e)]
        return {a: tuple(sorted(g, key=lambda grp: grp[0])) for a, g in out.items()}

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis` ("sp", "cfg", "dp", "ep"): rank lists in group-rank
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


def plan_topology(world_size: int, config: ParallelConfig) -> Topology:
    """Validate `config` for a world of `world_size` ranks; return the rank layout.

    Raises `ValueError` (naming the field and value) for a world size that does not equal
    `config.world_size`. Pure arithmetic: call it before creating any process group.
    """
    check_positive_int("world_size", world_size)
    if world_size != config.world_size:
        raise ValueError(
            f"world_size={world_size!r} does not equal the config's SP x CFG x DP = "
            f"{config.ulysses_degree} x {config.cfg_parallel_size} x "
            f"{config.data_parallel_size} = {config.world_size}"
        )
    return Topology(world_size=world_size, config=config,
                    expert_parallel_size=config.resolved_expert_parallel_size())
