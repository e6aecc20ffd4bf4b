"""Property tests of the real exchanges over 4 Gloo ranks, in one spawn.

Rank 0 runs a hypothesis test; for each example it broadcasts the drawn case to the other
ranks, every rank runs the exchange on its own deterministic input, and rank 0 gathers the
outputs and checks them against the reference model: the Ulysses round trip (plain and
fused) and scatter/gather over arbitrary replicated layouts (any contiguous parts).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headmoe.distributed.exchange import (
    ExchangeWorkspace,
    HeadLayout,
    gather_heads,
    scatter_heads,
    ulysses_heads_to_seq,
    ulysses_qkv_to_heads,
    ulysses_seq_to_heads,
)
from headmoe.testing import run_ranks
from tests.distributed import exchange_reference as ref

PARTITIONS = {"world": [(0, 1, 2, 3)], "pairs": [(0, 1), (2, 3)]}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64}
MAX_EXAMPLES = 80


@st.composite
def cases(draw) -> dict:
    kind = draw(st.sampled_from(["ulysses", "ulysses_fused", "moe"]))
    partition = draw(st.sampled_from(list(PARTITIONS)))
    world = len(PARTITIONS[partition][0])
    counts = tuple(draw(st.lists(st.integers(0, 5), min_size=world, max_size=world)))
    parts = None
    shards = world
    if kind == "moe":
        replicas = draw(st.sampled_from([r for r in (1, 2, 4) if world % r == 0]))
        if replicas > 1 or draw(st.booleans()):
            parts = []
            for n in counts:
                cuts = sorted(draw(st.lists(st.integers(0, n), min_size=replicas - 1,
                                            max_size=replicas - 1)))  # fmt: skip
                bounds = [0, *cuts, n]
                parts.append(tuple(bounds[i + 1] - bounds[i] for i in range(replicas)))
            parts = tuple(parts)
        shards = world // replicas
    return {
        "kind": kind,
        "partition": partition,
        "counts": counts,
        "parts": parts,
        "heads": shards * draw(st.integers(1, 3)),
        "dim": draw(st.integers(1, 3)),
        "dtype": draw(st.sampled_from(list(DTYPES))),
        "noncontig": draw(st.booleans()),
        "workspace": draw(st.booleans()),
        "seed": draw(st.integers(0, 10**6)),
    }


def _input(case: dict, rank: int, rows: int) -> torch.Tensor:
    inner = (3, case["heads"]) if case["kind"] == "ulysses_fused" else (case["heads"],)
    shape = (rows, *inner, case["dim"])
    dtype = DTYPES[case["dtype"]]
    if case["noncontig"]:  # same values, transposed storage
        return ref.make_input(shape[::-1], rank, dtype, case["seed"]).permute(
            *range(len(shape) - 1, -1, -1)
        )
    return ref.make_input(shape, rank, dtype, case["seed"])


def _execute(case: dict, rank: int, groups: dict, ws: ExchangeWorkspace) -> dict:
    members, group = next((m, g) for m, g in groups[case["partition"]] if rank in m)
    g = members.index(rank)
    counts = case["counts"]
    x = _input(case, rank, counts[g])
    if case["kind"] == "moe":
        layout = HeadLayout(counts, g, case["parts"])
        wsp = ws if case["workspace"] else None
        y = scatter_heads(x, group, layout, workspace=wsp)
        back = gather_heads(y, group, layout, workspace=wsp)
    elif case["kind"] == "ulysses":
        y = ulysses_seq_to_heads(x, group, counts)
        back = ulysses_heads_to_seq(y, group, counts)
    else:
        y = ulysses_qkv_to_heads(x, group, counts)
        back = torch.stack([ulysses_heads_to_seq(y[:, i], group, counts) for i in range(3)], 1)
    return {"y": y.clone(), "back": back.clone()}


def _check(case: dict, outputs: list[dict]) -> None:
    for members in PARTITIONS[case["partition"]]:
        xs = [_input(case, r, case["counts"][g]) for g, r in enumerate(members)]
        if case["kind"] == "moe":
            want = ref.scatter(xs, case["counts"], case["parts"])
        else:
            want = ref.seq_to_heads(xs)
        for g, r in enumerate(members):
            assert torch.equal(outputs[r]["y"], want[g]), (case, r)
            assert torch.equal(outputs[r]["back"], xs[g]), (case, r)


def _run(rank: int, world_size: int) -> int:
    groups = {"world": [((0, 1, 2, 3), dist.new_group([0, 1, 2, 3]))]}
    groups["pairs"] = [(m, dist.new_group(list(m))) for m in PARTITIONS["pairs"]]
    ws = ExchangeWorkspace()

    def step(case: dict | None) -> list[dict] | None:
        box = [case]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return None
        out = ref.to_bytes(_execute(box[0], rank, groups, ws))
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        return [ref.from_bytes(b) for b in gathered] if rank == 0 else []

    if rank != 0:
        served = 0
        while step(None) is not None:  # the case comes from rank 0's broadcast
            served += 1
        return served
    examples = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(cases())
    def prop(case):
        examples.append(case)
        _check(case, step(case))

    try:
        prop()
    finally:
        step(None)
    return len(examples)


@pytest.mark.multirank
def test_exchange_properties_over_4_ranks():
    served = run_ranks(_run, 4, timeout=300)
    assert served[0] >= MAX_EXAMPLES // 2
    assert served[1:] == [served[0]] * 3
