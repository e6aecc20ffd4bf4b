"""User-facing parallel configuration.

`ParallelConfig` is pure data: it says how many ranks each parallel axis takes and how the
MoE layers are cut. It is validated on construction, so a bad layout fails on every rank
before any process group exists. The rank arithmetic lives in
`headmoe.distributed.topology`; the worked tables in `docs/parallelism.md`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, TypeGuard

import torch

#: the transformer dtypes headmoe runs, by name: the one dtype table (the MoE layer, the
#: models, the public schema's spellings and the request all take theirs from it)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: bytes in a GiB and a MiB (the units of every memory figure headmoe prints)
GIB, MIB = 1 << 30, 1 << 20

MoEExchange = Literal["auto", "ep_group", "sp_group"]
MOE_EXCHANGES: tuple[str, ...] = ("auto", "ep_group", "sp_group")


def is_int(value: object) -> TypeGuard[int]:
    """True for an `int` that is not a `bool` (the one integer test of headmoe)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """True for an `int` or `float` that is not a `bool`."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_positive_int(name: str, value: object) -> int:
    """Return `value` if it is a strict positive `int` (not bool), else raise `ValueError`.

    The message names the field and the offending value, e.g.
    ``ulysses_degree must be a positive int, got 0``.
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_positive_number(name: str, value: object) -> float:
    """Return `value` if it is a finite number > 0 (int or float, not bool), else raise
    `ValueError` naming the field and the value."""
    if not is_number(value) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelConfig:
    """How one job's ranks are arranged.

    World size = SP x CFG x DP; expert parallelism never changes it (it only says how each
    SP group is cut into EP runs for the MoE layers).
    """

    ulysses_degree: int = 1
    """SP: ranks that share one sequence (Ulysses). Tokens are split over them, and attention
    heads during attention."""

    cfg_parallel_size: int = 1
    """CFG: 1 packs the conditional and unconditional branches in one sequence; 2 runs them on
    two SP groups and all-gathers the predictions once per step."""

    data_parallel_size: int = 1
    """DP: independent requests; no communication."""

    enable_expert_parallel: bool = False
    """Shard the MoE layers' heads over EP runs of the SP group (head-style expert
    parallelism: each EP rank holds all experts of its heads)."""

    expert_parallel_size: int | None = None
    """EP degree: must divide `ulysses_degree`; None means the whole SP group. Setting it
    requires `enable_expert_parallel`."""

    moe_exchange: str = "auto"
    """Where MoE tokens are exchanged: "ep_group" (inside each EP run), "sp_group" (over the
    whole SP group with SP/EP replicated head owners) or "auto" (chosen by the MoE layer; see
    docs/parallelism.md)."""

    def __post_init__(self) -> None:
        for name in (
            "ulysses_degree",
            "cfg_parallel_size",
            "data_parallel_size",
        ):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}"
            )
        if self.expert_parallel_size is not None:
            check_positive_int("expert_parallel_size", self.expert_parallel_size)
            if not self.enable_expert_parallel:
                raise ValueError(
                    f"expert_parallel_size={self.expert_parallel_size!r} requires "
                    "enable_expert_parallel=True"
                )
            if self.ulysses_degree % self.expert_parallel_size:
                raise ValueError(
                    f"expert_parallel_size={self.expert_parallel_size!r} must divide "
                    f"ulysses_degree={self.ulysses_degree!r}"
                )
        if self.moe_exchange not in MOE_EXCHANGES:
            raise ValueError(
                f"moe_exchange must be one of {MOE_EXCHANGES}, got {self.moe_exchange!r}"
            )

    @property
    def sequence_parallel_size(self) -> int:
        """The SP degree (alias of `ulysses_degree`)."""
        return self.ulysses_degree

    @property
    def world_size(self) -> int:
        """SP x CFG x DP. EP does not enter."""
        return self.ulysses_degree * self.cfg_parallel_size * self.data_parallel_size

    def resolved_expert_parallel_size(self) -> int:
        """The EP degree this config means: the SP degree with EP off or unset (MAGI-2's
        "EP off" is EP = SP), otherwise the set value."""
        if self.expert_parallel_size is None or not self.enable_expert_parallel:
            return self.ulysses_degree
        return self.expert_parallel_size

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        """Inverse of `to_dict`; unknown keys are rejected by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ParallelConfig field(s): {', '.join(unknown)}")
        return cls(**data)
