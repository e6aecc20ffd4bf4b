"""Layout names ("sp4,ep2,sp_group") and the enumeration of every valid layout of a world.

A layout name is a comma-separated list of tokens: `spN` (Ulysses degree, default 1),
`cfgN` (1 or 2), `dpN`, `epN` (head-style EP degree, a divisor of SP; default SP, MAGI-2's
"EP off") and at most one exchange mode `ep_group` / `sp_group` / `auto` (default).
"""

from __future__ import annotations

import re

from headmoe.config import MOE_EXCHANGES, ParallelConfig
from headmoe.models.magi2.config import Magi2Config, validate_parallel

_TOKEN = re.compile(r"^(sp|cfg|dp|ep)([1-9][0-9]*)$")


def parse_layout(name: str) -> ParallelConfig:
    """`ParallelConfig` of a layout name; `ValueError` naming the bad token or field."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"layout must be a non-empty string like 'sp4,ep2', got {name!r}")
    sizes: dict[str, int] = {}
    mode = "auto"
    for token in (t.strip().lower() for t in name.split(",")):
        m = _TOKEN.match(token)
        if token in MOE_EXCHANGES:
            mode = token
        elif m and m.group(1) not in sizes:
            sizes[m.group(1)] = int(m.group(2))
        else:
            raise ValueError(f"layout {name!r}: bad or repeated token {token!r}")
    sp = sizes.get("sp", 1)
    ep = sizes.get("ep")
    explicit = ep is not None and ep != sp
    parallel = ParallelConfig(
        ulysses_degree=sp, cfg_parallel_size=sizes.get("cfg", 1),
        data_parallel_size=sizes.get("dp", 1), enable_expert_parallel=explicit,
        expert_parallel_size=ep if explicit else None, moe_exchange=mode,
    )
    return parallel


def layout_name(parallel: ParallelConfig) -> str:
    """The canonical name of a layout (`parse_layout(layout_name(p))` equals `p` for every
    config `parse_layout` can return)."""
    parts = [f"sp{parallel.ulysses_degree}"]
    if parallel.cfg_parallel_size > 1:
        parts.append(f"cfg{parallel.cfg_parallel_size}")
    if parallel.data_parallel_size > 1:
        parts.append(f"dp{parallel.data_parallel_size}")
    ep = parallel.resolved_expert_parallel_size()
    if ep != parallel.ulysses_degree:
        parts.append(f"ep{ep}")
    if parallel.moe_exchange != "auto":
        parts.append(parallel.moe_exchange)
    return ",".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: Magi2Config, world_size: int) -> list[ParallelConfig]:
    """Every layout of `world_size` ranks the MAGI-2 transformer accepts (SP a divisor
    of the attention heads; CFG 1 or 2; DP the rest; EP every divisor of SP), with each
    exchange mode when it matters (EP < SP), ordered by SP descending, then CFG, EP
    descending, mode. EP = SP is written with EP off (the same thing for MAGI-2)."""
    out = []
    for sp in reversed(_divisors(world_size)):
        for cfg in (1, 2):
            if world_size % (sp * cfg):
                continue
            for ep in reversed(_divisors(sp)):
                for mode in ("ep_group", "sp_group") if ep < sp else ("auto",):
                    p = ParallelConfig(
                        ulysses_degree=sp, cfg_parallel_size=cfg,
                        data_parallel_size=world_size // (sp * cfg),
                        enable_expert_parallel=ep < sp,
                        expert_parallel_size=ep if ep < sp else None, moe_exchange=mode,
                    )
                    try:
                        validate_parallel(model, p)
                    except ValueError:
                        continue
                    out.append(p)
    return out
