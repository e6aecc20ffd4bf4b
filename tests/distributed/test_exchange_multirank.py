"""Gloo multi-rank tests of the exchanges against the one-process reference model.

One spawn of 4 ranks runs every case (`_run_all`); the tests below check its results in the
parent with `torch.equal`. Inputs encode their source rank and position; between scatter
and gather each owner applies a per-row function of its own rank, so the gathered values
prove which rank computed each head block.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from headmoe.config import ParallelConfig
from headmoe.distributed import Counters, ParallelContext
from headmoe.distributed.exchange import (
    ExchangeWorkspace,
    HeadLayout,
    gather_heads,
    replica_token_counts,
    scatter_heads,
    ulysses_heads_to_seq,
    ulysses_qkv_to_heads,
    ulysses_seq_to_heads,
)
from headmoe.testing import run_ranks
from tests.distributed import exchange_reference as ref

WORLD = 4
PARTITIONS = {
    "world": [(0, 1, 2, 3)],
    "pairs": [(0, 1), (2, 3)],
    "strided": [(0, 2), (1, 3)],
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int32": torch.int32}


@dataclass(frozen=True)
class Case:
    name: str
    partition: str
    counts: tuple[int, ...]
    heads: int
    dim: int
    dtype: str = "fp32"
    replicas: int = 1
    policy: str = "run_totals"
    noncontig: bool = False
    workspace: bool = False
    fused: bool = False  # Ulysses: q, k, v in one exchange

    def parts(self):
        if self.replicas == 1:
            return None
        return replica_token_counts(self.counts, self.replicas, self.policy)


def _moe_cases() -> list[Case]:
    cases = []
    for counts in [(2, 2, 2, 2), (0, 1, 2, 3), (0, 0, 0, 0)]:
        for dt in DTYPES:
            cases.append(Case(f"world{counts}-{dt}", "world", counts, 12, 4, dt))
    cases.append(Case("world-noncontig", "world", (3, 1, 0, 2), 8, 3, noncontig=True))
    cases.append(Case("world-ws", "world", (1, 4, 2, 3), 12, 4, "bf16", workspace=True))
    for part in ["pairs", "strided"]:
        for counts in [(3, 1), (0, 2), (2, 5)]:
            cases.append(Case(f"{part}{counts}", part, counts, 6, 4, "int32", workspace=True))
    for counts in [(4, 4, 4, 4), (5, 3, 3, 3), (3, 0, 1, 6), (1, 1, 1, 1), (0, 0, 0, 0)]:
        for policy in ["run_totals", "balanced"]:
            for dt in ["fp32", "bf16"]:
                cases.append(
                    Case(
                        f"rep{counts}-{policy}-{dt}",
                        "world",
                        counts,
                        12,
                        4,
                        dt,
                        2,
                        policy,
                        noncontig=counts == (5, 3, 3, 3),
                        workspace=dt == "bf16",
                    )
                )
    cases.append(Case("rep-int32", "world", (3, 0, 1, 6), 12, 4, "int32", 2, "balanced"))
    cases.append(Case("rep4", "world", (2, 3, 0, 1), 4, 2, "fp32", 4, "balanced"))
    return cases


def _ulysses_cases() -> list[Case]:
    cases = []
    for counts in [(2, 2, 2, 2), (0, 1, 2, 3), (0, 0, 0, 0), (5, 0, 0, 1)]:
        for dt in DTYPES:
            for fused in [False, True]:
                cases.append(
                    Case(f"u{counts}-{dt}-{fused}", "world", counts, 8, 3, dt, fused=fused)
                )
    for part in ["pairs", "strided"]:
        cases.append(Case(f"u-{part}", part, (3, 1), 4, 2, "int32"))
        cases.append(Case(f"u-{part}-fused", part, (0, 4), 4, 2, "bf16", fused=True))
    cases.append(Case("u-noncontig", "world", (1, 3, 2, 0), 8, 2, noncontig=True))
    cases.append(Case("u-noncontig-fused", "world", (1, 3, 2, 0), 8, 2, noncontig=True, fused=True))
    return cases


MOE_CASES = _moe_cases()
ULYSSES_CASES = _ulysses_cases()


def case_input(case: Case, src_global: int, rows: int, seed: int) -> torch.Tensor:
    """The input of global rank `src_global` (non-contiguous when the case says so)."""
    inner = (3, case.heads) if case.fused else (case.heads,)
    dtype = DTYPES[case.dtype]
    if not case.noncontig:
        return ref.make_input((rows, *inner, case.dim), src_global, dtype, seed)
    x = ref.make_input((case.dim, rows, *inner), src_global, dtype, seed)
    return x.movedim(0, -1)


def owner_fn(y: torch.Tensor, tag: int) -> torch.Tensor:
    """A per-row function of the owner (`tag`); exact in int32 and in fp32 for our codes."""
    return y * 3 + (tag + 1) * 7


def weights_fn(y: torch.Tensor, shard: int) -> torch.Tensor:
    """A per-row function of the head shard only (the same weights in every EP run)."""
    return y * (shard + 2) - y.flip(-1)


def _group_of(groups: dict, partition: str, rank: int):
    for members, group in groups[partition]:
        if rank in members:
            return members, group
    raise AssertionError(rank)


# ---------------------------------------------------------------------------- rank side
def _run_all(rank: int, world_size: int) -> dict:
    ctx = ParallelContext.initialize(
        ParallelConfig(ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=2)
    )
    groups = {"world": [((0, 1, 2, 3), ctx.group("sp"))]}
    for name in ["pairs", "strided"]:
        groups[name] = [(m, dist.new_group(list(m))) for m in PARTITIONS[name]]
    ws = ExchangeWorkspace()
    out: dict = {"moe": {}, "ulysses": {}}
    with ref.CollectiveRecorder() as rec:
        for i, case in enumerate(MOE_CASES):
            out["moe"][case.name] = _moe_case(case, i, rank, groups, ctx, ws, rec)
        for i, case in enumerate(ULYSSES_CASES):
            out["ulysses"][case.name] = _ulysses_case(case, i, rank, groups, rec)
    out["bad"] = _bad_inputs(rank, groups)
    out["acceptance"] = _acceptance(rank, groups)
    ctx.destroy()
    return ref.to_bytes(out)


def _moe_case(case, seed, rank, groups, ctx, ws, rec) -> dict:
    members, group = _group_of(groups, case.partition, rank)
    g = members.index(rank)
    layout = HeadLayout(case.counts, g, case.parts())
    x = case_input(case, rank, case.counts[g], seed)
    counters = Counters()
    n_calls = len(rec.calls)
    wsp = ws if case.workspace else None
    y = scatter_heads(x, group, layout, workspace=wsp, counters=counters)
    y_copy = y.clone()
    z = owner_fn(y, g)
    if case.noncontig:
        z = z.transpose(0, 1).contiguous().transpose(0, 1)
    back = gather_heads(z, group, layout, workspace=wsp, counters=counters)
    res = {
        "scatter": y_copy,
        "gather": back.clone(),
        "scatter_kept": torch.equal(y, y_copy),  # the gather did not overwrite it
        "calls": [c[0] for c in rec.calls[n_calls:]],
        "records": [(r.kind, r.bytes_sent, r.bytes_received) for r in counters.exchanges],
    }
    if case.replicas == 2:  # EP runs (0, 1), (2, 3) of the context
        shard = g % layout.shards
        rep = gather_heads(weights_fn(scatter_heads(x, group, layout), shard), group, layout)
        run = ctx.group_ranks("ep")
        run_layout = HeadLayout(tuple(case.counts[r] for r in run), ctx.group_rank("ep"))
        ep = ctx.group("ep")
        in_run = gather_heads(weights_fn(scatter_heads(x, ep, run_layout), shard), ep, run_layout)
        res["replicated"], res["in_run"] = rep, in_run
    return res


def _ulysses_case(case, seed, rank, groups, rec) -> dict:
    members, group = _group_of(groups, case.partition, rank)
    g = members.index(rank)
    x = case_input(case, rank, case.counts[g], seed)
    counters = Counters()
    n_calls = len(rec.calls)
    if case.fused:
        y = ulysses_qkv_to_heads(x, group, case.counts, counters=counters)
        back = None
    else:
        y = ulysses_seq_to_heads(x, group, case.counts, counters=counters)
        back = ulysses_heads_to_seq(owner_fn(y, g), group, case.counts, counters=counters)
    return {
        "heads": y,
        "seq": back,
        "calls": [c[0] for c in rec.calls[n_calls:]],
        "records": [(r.kind, r.bytes_sent, r.bytes_received) for r in counters.exchanges],
    }


def _bad_inputs(rank: int, groups: dict) -> dict:
    """Every rank makes the same bad call; each must raise ValueError and issue nothing."""
    world = groups["world"][0][1]
    pair_members, pair = _group_of(groups, "pairs", rank)
    good = HeadLayout((2, 2, 2, 2), rank)
    x = torch.zeros(2, 12, 4)
    bad = {
        "layout size != group": lambda: scatter_heads(x, world, HeadLayout((2, 2), 0)),
        "layout rank != group rank": lambda: scatter_heads(
            x, world, HeadLayout((2, 2, 2, 2), (rank + 1) % 4)
        ),
        "group None, world 4": lambda: scatter_heads(x, None, good),
        "x rank 2": lambda: scatter_heads(x[:, :, 0], world, good),
        "x dim0": lambda: scatter_heads(torch.zeros(3, 12, 4), world, good),
        "H not divisible": lambda: scatter_heads(torch.zeros(2, 10, 4), world, good),
        "D zero": lambda: scatter_heads(torch.zeros(2, 12, 0), world, good),
        "gather dim0": lambda: gather_heads(torch.zeros(7, 3, 4), world, good),
        "gather rank 4": lambda: gather_heads(torch.zeros(8, 3, 4, 1), world, good),
        "replicas H": lambda: scatter_heads(
            torch.zeros(2, 3, 4),
            world,
            HeadLayout((2, 2, 2, 2), rank, replica_token_counts((2, 2, 2, 2), 2)),
        ),
        "not a layout": lambda: scatter_heads(x, world, (2, 2, 2, 2)),
        "ulysses counts length": lambda: ulysses_seq_to_heads(x, world, (2, 2)),
        "ulysses counts type": lambda: ulysses_seq_to_heads(x, world, [2, 2, 2, 2]),
        "ulysses dim0": lambda: ulysses_seq_to_heads(x, world, (3, 3, 3, 3)),
        "ulysses H": lambda: ulysses_seq_to_heads(torch.zeros(2, 6, 4), world, (2, 2, 2, 2)),
        "ulysses qkv 3": lambda: ulysses_qkv_to_heads(torch.zeros(2, 2, 8, 4), world, (2,) * 4),
        "ulysses qkv rank": lambda: ulysses_qkv_to_heads(x, world, (2,) * 4),
        "ulysses out dim0": lambda: ulysses_heads_to_seq(torch.zeros(7, 3, 4), world, (2,) * 4),
        "ulysses pair counts": lambda: ulysses_seq_to_heads(x, pair, (2, 2, 2, 2)),
    }
    out = {}
    for name, call in bad.items():
        with ref.CollectiveRecorder(forward=False) as rec:
            try:
                call()
                out[name] = ("no error", [])
            except ValueError as e:
                out[name] = (str(e), [c[0] for c in rec.calls])
    # the groups still work: no rank was left inside a collective
    y = scatter_heads(x + rank, world, good)
    out["after"] = y[:, :, 0].tolist()
    return out


def _acceptance(rank: int, groups: dict) -> dict:
    members, group = _group_of(groups, "pairs", rank)
    g = members.index(rank)
    layout = HeadLayout((2, 5), g)
    x = torch.zeros(layout.local_tokens, 6, 4)
    with ref.CollectiveRecorder() as rec:
        y = scatter_heads(x, group, layout)
    calls = [
        (
            name,
            kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None),
            kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None),
        )
        for name, args, kwargs in rec.calls
    ]
    return {"shape": tuple(y.shape), "calls": calls}


# ---------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def results():
    return [ref.from_bytes(b) for b in run_ranks(_run_all, WORLD, timeout=300)]


def _inputs(case: Case, members: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    return [case_input(case, r, case.counts[g], seed) for g, r in enumerate(members)]


def _expected_bytes(case: Case, g: int, row_elems: int, esize: int) -> tuple[int, int]:
    """(sent, received) bytes of group rank g's scatter, from the part sizes alone."""
    world = len(case.counts)
    parts = case.parts() or tuple((n,) for n in case.counts)
    shards = world // len(parts[0])
    sent = sum(parts[g][dst // shards] for dst in range(world) if dst != g)
    recv = sum(parts[src][g // shards] for src in range(world) if src != g)
    return sent * row_elems * esize, recv * row_elems * esize


@pytest.mark.multirank
def test_moe_scatter_gather_match_reference(results):
    checked = 0
    for seed, case in enumerate(MOE_CASES):
        for members in PARTITIONS[case.partition]:
            xs = _inputs(case, members, seed)
            parts = case.parts()
            want_y = ref.scatter(xs, case.counts, parts)
            want_back = ref.gather(
                [owner_fn(y, g) for g, y in enumerate(want_y)], case.counts, parts
            )
            for g, r in enumerate(members):
                got = results[r]["moe"][case.name]
                assert got["scatter"].dtype == DTYPES[case.dtype]
                assert torch.equal(got["scatter"], want_y[g]), (case, r)
                assert torch.equal(got["gather"], want_back[g]), (case, r)
                assert got["scatter_kept"], (case, r)
                checked += 1
    assert checked == sum(
        len(PARTITIONS[c.partition][0]) * len(PARTITIONS[c.partition]) for c in MOE_CASES
    )


@pytest.mark.multirank
def test_each_head_block_computed_by_its_owner(results):
    """Direct check, without the reference's gather: head j of token t of source s must be
    `owner_fn(x, o)` where o owns j's shard for the part holding t."""
    for seed, case in enumerate(MOE_CASES):
        for members in PARTITIONS[case.partition]:
            world = len(members)
            xs = _inputs(case, members, seed)
            parts = case.parts() or tuple((n,) for n in case.counts)
            for g, r in enumerate(members):
                got = results[r]["moe"][case.name]["gather"]
                for p, (a, b) in enumerate(ref.part_bounds(list(parts[g]))):
                    for j in range(case.heads):
                        o = ref.owner_of(world, len(parts[0]), p, j, case.heads)
                        assert torch.equal(got[a:b, j], owner_fn(xs[g][a:b, j], o)), (case, j)


@pytest.mark.multirank
def test_replicated_exchange_equals_in_run_exchange(results):
    cases = [c for c in MOE_CASES if c.replicas == 2]
    assert len(cases) == 21
    for seed, case in enumerate(MOE_CASES):
        if case.replicas != 2:
            continue
        xs = _inputs(case, (0, 1, 2, 3), seed)
        h = case.heads // 2
        for r in range(WORLD):
            got = results[r]["moe"][case.name]
            assert torch.equal(got["replicated"], got["in_run"]), (case, r)
            want = torch.cat(
                [weights_fn(xs[r][:, s * h : (s + 1) * h], s) for s in range(2)], dim=1
            )
            assert torch.equal(got["in_run"], want), (case, r)


@pytest.mark.multirank
def test_one_all_to_all_per_direction_and_counted_bytes(results):
    for case in MOE_CASES:
        for members in PARTITIONS[case.partition]:
            world = len(members)
            parts = case.parts() or ((0,),) * world
            shards = world // len(parts[0])
            for g, r in enumerate(members):
                got = results[r]["moe"][case.name]
                if sum(case.counts) == 0:
                    assert got["calls"] == [] and got["records"] == []
                    continue
                assert got["calls"] == ["all_to_all_single"] * 2, case
                esize = torch.empty((), dtype=DTYPES[case.dtype]).element_size()
                sent, recv = _expected_bytes(case, g, case.heads // shards * case.dim, esize)
                assert got["records"] == [
                    ("moe_scatter", sent, recv),
                    ("moe_gather", recv, sent),
                ], case


@pytest.mark.multirank
def test_ulysses_match_reference(results):
    for seed, case in enumerate(ULYSSES_CASES):
        for members in PARTITIONS[case.partition]:
            world = len(members)
            xs = _inputs(case, members, seed)
            want = ref.seq_to_heads(xs)
            want_seq = ref.heads_to_seq([owner_fn(y, g) for g, y in enumerate(want)], case.counts)
            esize = torch.empty((), dtype=DTYPES[case.dtype]).element_size()
            row = (3 if case.fused else 1) * case.heads // world * case.dim * esize
            for g, r in enumerate(members):
                got = results[r]["ulysses"][case.name]
                assert torch.equal(got["heads"], want[g]), (case, r)
                total, mine = sum(case.counts), case.counts[g]
                sent, recv = (mine * (world - 1)) * row, (total - mine) * row
                if case.fused:
                    assert got["seq"] is None
                    records = [("ulysses_in", sent, recv)]
                else:
                    assert torch.equal(got["seq"], want_seq[g]), (case, r)
                    records = [("ulysses_in", sent, recv), ("ulysses_out", recv, sent)]
                if total == 0:
                    records = []
                assert got["records"] == records, case
                assert got["calls"] == ["all_to_all_single"] * len(records), case


@pytest.mark.multirank
def test_bad_input_raises_everywhere_before_any_collective(results):
    for r in range(WORLD):
        bad = results[r]["bad"]
        assert len(bad) == 20
        for name, value in bad.items():
            if name == "after":
                continue
            message, calls = value
            assert message != "no error", (r, name)
            assert calls == [], (r, name, calls)
        assert bad["after"] == [[float(src)] * 3 for src in range(WORLD) for _ in range(2)]
    assert "x.shape[0]" in results[0]["bad"]["x dim0"][0]
    assert "10 heads" in results[0]["bad"]["H not divisible"][0]


@pytest.mark.multirank
def test_acceptance_layout_2_5(results):
    got = results[0]["acceptance"]
    assert got["shape"] == (7, 3, 4)
    assert got["calls"] == [("all_to_all_single", [24, 60], [24, 24])]
    assert results[1]["acceptance"]["calls"] == [("all_to_all_single", [24, 60], [60, 60])]
