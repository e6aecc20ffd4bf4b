"""Process groups built from a Topology, checked with real Gloo all-to-alls."""

import time

import pytest
import torch
import torch.distributed as dist

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext, plan_topology
from headmoe.testing import RankFailure, RankTimeout, run_ranks

EP = dict(enable_expert_parallel=True)
LAYOUTS_4 = [
    ParallelConfig(ulysses_degree=2, cfg_parallel_size=2, expert_parallel_size=2, **EP),
    ParallelConfig(ulysses_degree=4, expert_parallel_size=2, **EP),
    ParallelConfig(ulysses_degree=2, data_parallel_size=2, expert_parallel_size=2, **EP),
    ParallelConfig(ulysses_degree=4, expert_parallel_size=1, **EP),
]
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _exchange_rank_ids(ctx):
    """For every axis: all_to_all_single of this rank's id over the axis group, per dtype.
    Returns {axis: {dtype name: received list}}."""
    seen = {}
    for axis in ("sp", "cfg", "dp", "ep"):
        group = ctx.group(axis)
        n = len(ctx.group_ranks(axis))
        assert (group is None) == (n == 1), axis
        if group is not None:
            assert dist.get_world_size(group) == n
            assert dist.get_rank(group) == ctx.group_rank(axis)
        per = {}
        for dtype in DTYPES:
            x = torch.full((n * 2,), ctx.rank, dtype=dtype)
            if group is None:
                y = x
            else:
                y = torch.empty_like(x)
                dist.all_to_all_single(y, x, group=group)
            per[str(dtype)] = y.tolist()
        seen[axis] = per
    return seen


def _run_layouts(rank, world_size, configs):
    out = []
    for config in configs:
        ctx = ParallelContext.initialize(config)
        assert ctx.rank == rank and ctx.world_size == world_size
        out.append(_exchange_rank_ids(ctx))
        ctx.destroy()  # then re-initialise the next layout in the same processes
    return out


def _check(results, configs):
    for i, config in enumerate(configs):
        topo = plan_topology(len(results), config)
        for rank, per_rank in enumerate(results):
            for axis, per_dtype in per_rank[i].items():
                members = topo.group_of(axis, rank)
                expected = [float(m) for m in members for _ in range(2)]
                for dtype_name, got in per_dtype.items():
                    assert [float(v) for v in got] == expected, (config, rank, axis, dtype_name)


@pytest.mark.multirank
def test_four_rank_layouts_reinitialised_in_same_processes():
    results = run_ranks(_run_layouts, 4, args=(LAYOUTS_4,), timeout=300)
    _check(results, LAYOUTS_4)


@pytest.mark.multirank
def test_eight_ranks_sp8_ep4():
    configs = [ParallelConfig(ulysses_degree=8, expert_parallel_size=4, **EP)]
    results = run_ranks(_run_layouts, 8, args=(configs,), timeout=300)
    _check(results, configs)
    assert results[5][0]["ep"][str(torch.int64)] == [4, 4, 5, 5, 6, 6, 7, 7]


def test_bad_layout_creates_no_group(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("init"))
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: calls.append("new_group"))
    for ep in (3, 8):  # refused by the config itself, before any context exists
        with pytest.raises(ValueError, match=f"expert_parallel_size={ep} must divide"):
            ParallelConfig(ulysses_degree=4, expert_parallel_size=ep, **EP)
    with pytest.raises(ValueError, match="world_size=8 does not equal"):
        ParallelContext.initialize(
            ParallelConfig(ulysses_degree=4), rank=0, world_size=8, init_method="file:///x"
        )
    assert calls == []


def _failing_group_creation(rank, world_size):
    real_new, real_destroy = dist.new_group, dist.destroy_process_group
    created, destroyed = [], []

    def new_group(*args, **kwargs):
        if len(created) == 2:
            raise RuntimeError("injected failure creating the third group")
        g = real_new(*args, **kwargs)
        created.append(g)
        return g

    def destroy(group=None):
        destroyed.append(group)
        real_destroy(group)

    dist.new_group, dist.destroy_process_group = new_group, destroy
    try:
        ParallelContext.initialize(ParallelConfig(ulysses_degree=2, data_parallel_size=2))
    except RuntimeError as e:
        assert "injected failure" in str(e)
    else:
        raise AssertionError("initialize did not propagate the failure")
    finally:
        dist.new_group, dist.destroy_process_group = real_new, real_destroy
    assert len(created) == 2
    assert sorted(map(id, destroyed)) == sorted(map(id, created))
    # the default group is not ours, so it survives and still works
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.multirank
def test_group_creation_is_transactional():
    assert run_ranks(_failing_group_creation, 4, timeout=300) == [4.0] * 4


def test_single_context():
    ctx = ParallelContext.single()
    assert ctx.world_size == 1 and ctx.group("sp") is None and ctx.group_ranks("ep") == [0]
    with pytest.raises(ValueError, match="axis must be one of .* got 'xx'"):
        ctx.group("xx")


def _hang_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("boom from rank one")
    time.sleep(3600)  # rank 0 is still busy; the harness kills it after a grace period
    return rank


@pytest.mark.multirank
def test_harness_names_the_hanging_rank_within_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match="rank 1") as info:
        run_ranks(_hang_on_rank_one, 2, timeout=20)
    assert info.value.hung == [1]
    assert time.monotonic() - start < 20 + 15


@pytest.mark.multirank
def test_harness_reports_failed_rank_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2, timeout=120)
    err = info.value
    assert list(err.failures) == [1]
    assert "KeyError: 'boom from rank one'" in err.failures[1]
    assert "_raise_on_rank_one" in err.failures[1]
    assert err.hung == [0]
    assert "rank 1 failed" in str(err)


def test_nccl_rank_takes_its_local_gpu_before_the_default_group(monkeypatch):
    """Without a GPU: the CUDA and process-group calls are recorded, not made. Under
    torchrun each rank must make `cuda:LOCAL_RANK` current before NCCL starts (else every
    rank of a node lands on GPU 0); without LOCAL_RANK, `rank % device_count`."""
    calls, state = [], {"init": False}

    def init_process_group(**kw):
        calls.append(("init", kw["backend"], kw["rank"]))
        state["init"] = True

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", str(d))))
    monkeypatch.setattr(dist, "is_initialized", lambda: state["init"])
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: object())
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: state.update(init=False))
    config = ParallelConfig(data_parallel_size=8)

    def devices(backend, local_rank):
        calls.clear()
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        ctx = ParallelContext.initialize(
            config, rank=5, world_size=8, init_method="tcp://127.0.0.1:1", backend=backend
        )
        ctx.destroy()
        return str(ctx.device), list(calls)

    assert devices("nccl", "3") == ("cuda:3", [("set", "cuda:3"), ("init", "nccl", 5)])
    assert devices("nccl", None) == ("cuda:1", [("set", "cuda:1"), ("init", "nccl", 5)])
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert devices("gloo", "3") == ("cpu", [("init", "gloo", 5)])
    calls.clear()
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match="LOCAL_RANK=4"):
        ParallelContext.initialize(config, rank=5, world_size=8, backend="nccl")
    assert calls == []  # nothing started
