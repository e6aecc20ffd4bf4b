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


def test_tp2_sp4_cfg2_dp2_standard():
    t = plan_topology(
        32,
        cfg(
            tensor_parallel_size=2,
            ulysses_degree=4,
            cfg_parallel_size=2,
            data_parallel_size=2,
            enable_expert_parallel=True,
        ),
        expert_parallel_style="standard",
    )
    assert t.groups("tp") == [[2 * i, 2 * i + 1] for i in range(16)]
    assert t.groups("sp") == [
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15],
        [16, 18, 20, 22], [17, 19, 21, 23], [24, 26, 28, 30], [25, 27, 29, 31],
    ]  # fmt: skip
    assert t.groups("cfg") == [
        [0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15],
        [16, 24], [17, 25], [18, 26], [19, 27], [20, 28], [21, 29], [22, 30], [23, 31],
    ]  # fmt: skip
    assert t.groups("dp") == [[r, r + 16] for r in range(16)]
    assert t.groups("ep") == [list(range(32))]
    c = t.coords(27)  # 27 = 1 + 2 * (1 + 4 * (1 + 2 * 1))
    assert (c.tp, c.sp, c.cfg, c.dp) == (1, 1, 1, 1)


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
    tp = draw(st.integers(1, 3))
    sp = draw(st.integers(1, 8))
    cfg_ = draw(st.integers(1, 2))
    dp = draw(st.integers(1, 3))
    style = draw(st.sampled_from(["head", "standard"]))
    enable = draw(st.booleans())
    ep = None
    if style == "head" and enable:
        tp = 1
        ep = draw(st.sampled_from([d for d in range(1, sp + 1) if sp % d == 0] + [None]))
    config = ParallelConfig(
        tensor_parallel_size=tp,
        ulysses_degree=sp,
        cfg_parallel_size=cfg_,
        data_parallel_size=dp,
        enable_expert_parallel=enable,
        expert_parallel_size=ep,
    )
    return config, style


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_properties(layout):
    config, style = layout
    world = config.world_size
    t = plan_topology(world, config, style)
    degree = {"tp": t.tp, "sp": t.sp, "cfg": t.cfg, "dp": t.dp}
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
        assert t.rank_of(c.tp, c.sp, c.cfg, c.dp) == r
    ep_groups = t.groups("ep")
    if style == "head":
        e = t.expert_parallel_size
        assert t.ep_replicas * e == t.sp
        for g in ep_groups:
            coords = [t.coords(r) for r in g]
            assert len(g) == e
            assert len({(c.tp, c.cfg, c.dp) for c in coords}) == 1
            sps = [c.sp for c in coords]
            assert sps == list(range(sps[0], sps[0] + e)) and sps[0] % e == 0
            assert [c.ep for c in coords] == list(range(e))
    elif config.enable_expert_parallel:
        assert ep_groups == [list(range(world))]
    else:
        assert ep_groups == [[r] for r in range(world)]
