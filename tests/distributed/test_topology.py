"""Topology arithmetic: golden tables (the ones in docs/parallelism.md) and properties."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headmoe.config import ParallelConfig
from headmoe.distributed.topology import AXES, plan_topology


def cfg(**kw):
    return ParallelConfig(**kw)


def test_sp8_default_ep_is_whole_sp_group():
    t = plan_topology(8, cfg(ulysses_degree=8))
    assert t.groups("sp") == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert t.groups("ep") == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert t.expert_parallel_size == 8 and t.ep_replicas == 1
    assert t.groups("cfg") == [[r] for r in range(8)]


def test_sp8_ep4():
    t = plan_topology(8, cfg(ulysses_degree=8, enable_expert_parallel=True, expert_parallel_size=4))
    assert t.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.ep_replicas == 2
    assert [t.coords(r).ep for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [t.coords(r).ep_run for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_sp4_cfg2_ep2():
    t = plan_topology(
        8,
        cfg(ulysses_degree=4, cfg_parallel_size=2, enable_expert_parallel=True, expert_parallel_size=2),
    )
    assert t.groups("sp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.groups("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups("dp") == [[r] for r in range(8)]
    assert t.group_of("cfg", 6) == [2, 6]
    assert t.group_of("ep", 5) == [4, 5]


def test_sp2_dp2_ep2():
    t = plan_topology(
        4,
        cfg(ulysses_degree=2, data_parallel_size=2, enable_expert_parallel=True, expert_parallel_size=2),
    )
    assert t.groups("sp") == [[0, 1], [2, 3]]
    assert t.groups("dp") == [[0, 2], [1, 3]]
    assert t.groups("ep") == [[0, 1], [2, 3]]
    assert t.ep_replicas == 1


def test_sp4_cfg2_dp2_ep2():
    t = plan_topology(
        16,
        cfg(ulysses_degree=4, cfg_parallel_size=2, data_parallel_size=2,
            enable_expert_parallel=True, expert_parallel_size=2),
    )
    assert t.groups("sp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert t.groups("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                               [11, 15]]
    assert t.groups("dp") == [[r, r + 8] for r in range(8)]
    assert t.groups("ep") == [[2 * i, 2 * i + 1] for i in range(8)]
    c = t.coords(13)  # 13 = 1 + 4 * (1 + 2 * 1)
    assert (c.sp, c.cfg, c.dp, c.ep, c.ep_run) == (1, 1, 1, 1, 0)


@pytest.mark.parametrize(
    ("world", "kw", "match"),
    [
        (4, dict(ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=3),
         "expert_parallel_size=3 must divide ulysses_degree=4"),
        (4, dict(ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=8),
         "expert_parallel_size=8 must divide ulysses_degree=4"),
        (8, dict(ulysses_degree=4), r"world_size=8 does not equal .* = 4"),
        (0, dict(), "world_size must be a positive int, got 0"),
    ],
)  # fmt: skip
def test_rejections(world, kw, match):
    with pytest.raises(ValueError, match=match):
        plan_topology(world, cfg(**kw))


def test_bad_axis_and_rank():
    t = plan_topology(2, cfg(ulysses_degree=2))
    with pytest.raises(ValueError, match="axis must be one of .* got 'pp'"):
        t.groups("pp")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        t.coords(2)


@st.composite
def layouts(draw):
    sp = draw(st.integers(1, 8))
    cfg_ = draw(st.integers(1, 2))
    dp = draw(st.integers(1, 3))
    enable = draw(st.booleans())
    ep = None
    if enable:
        ep = draw(st.sampled_from([d for d in range(1, sp + 1) if sp % d == 0] + [None]))
    return ParallelConfig(ulysses_degree=sp, cfg_parallel_size=cfg_, data_parallel_size=dp,
                          enable_expert_parallel=enable, expert_parallel_size=ep)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_properties(layout):
    config = layout
    world = config.world_size
    t = plan_topology(world, config)
    degree = {"sp": t.sp, "cfg": t.cfg, "dp": t.dp}
    for axis in AXES:
        groups = t.groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), axis  # a partition of the world
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        for g in groups:
            for r in g:
                assert t.group_of(axis, r) == g
        if axis in degree:
            for g in groups:
                assert len(g) == degree[axis]
                coords = [t.coords(r) for r in g]
                # members differ only in this axis's coordinate, in increasing order
                for other in set(degree) - {axis}:
                    assert len({getattr(c, other) for c in coords}) == 1
                assert [getattr(c, axis) for c in coords] == list(range(degree[axis]))
    for r in range(world):
        c = t.coords(r)
        assert t.rank_of(c.sp, c.cfg, c.dp) == r
    e = t.expert_parallel_size
    assert t.ep_replicas * e == t.sp
    for g in t.groups("ep"):
        coords = [t.coords(r) for r in g]
        assert len(g) == e
        assert len({(c.cfg, c.dp) for c in coords}) == 1
        sps = [c.sp for c in coords]
        assert sps == list(range(sps[0], sps[0] + e)) and sps[0] % e == 0
        assert [c.ep for c in coords] == list(range(e))
