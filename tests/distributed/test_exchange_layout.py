"""Pure parts of the exchange module (no processes): `HeadLayout`, `replica_token_counts`,
`ExchangeWorkspace`, the world of one rank, and bad input rejected before any collective
(checked against a fake group whose collectives are recorded, not issued)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

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
from tests.distributed import exchange_reference as ref

# ---------------------------------------------------------------------------- HeadLayout


def test_layout_derived_values_golden():
    lay = HeadLayout((2, 5), 0)
    assert (lay.world_size, lay.replicas, lay.shards) == (2, 1, 2)
    assert (lay.local_tokens, lay.total_tokens, lay.local_parts) == (2, 7, (2,))
    assert (lay.owned_counts, lay.owned_tokens, lay.send_counts) == ((2, 5), 7, (2, 2))
    # SP4 / EP2, counts (3, 0, 1, 6), rank 1 owns shard 1 of part 0
    lay = HeadLayout((3, 0, 1, 6), 1, ((0, 3), (0, 0), (0, 1), (3, 3)))
    assert (lay.replicas, lay.shards, lay.part, lay.shard) == (2, 2, 0, 1)
    assert (lay.owned_counts, lay.owned_tokens) == ((0, 0, 0, 3), 3)
    lay = HeadLayout((3, 0, 1, 6), 2, ((0, 3), (0, 0), (0, 1), (3, 3)))
    assert (lay.part, lay.shard, lay.owned_counts, lay.owned_tokens) == (1, 0, (3, 0, 1, 3), 7)
    assert (lay.local_parts, lay.send_counts) == ((0, 1), (0, 0, 1, 1))


def test_one_part_per_rank_is_the_plain_layout():
    for rank in range(3):
        a = HeadLayout((4, 0, 2), rank)
        b = HeadLayout((4, 0, 2), rank, ((4,), (0,), (2,)))
        for name in ["world_size", "replicas", "shards", "part", "shard", "parts",
                     "local_tokens", "total_tokens", "local_parts", "owned_counts",
                     "owned_tokens", "send_counts"]:  # fmt: skip
            assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(token_counts=(), rank=0), "token_counts"),
        (dict(token_counts=[1, 2], rank=0), "token_counts"),
        (dict(token_counts=(1, -1), rank=0), "token_counts[1]"),
        (dict(token_counts=(1, True), rank=0), "token_counts[1]"),
        (dict(token_counts=(1.0, 2), rank=0), "token_counts[0]"),
        (dict(token_counts=(1, 2), rank=2), "rank"),
        (dict(token_counts=(1, 2), rank=-1), "rank"),
        (dict(token_counts=(1, 2), rank=True), "rank"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=((1,),)), "replica_counts"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=[(1,), (2,)]), "replica_counts"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=((1,), (1, 1))), "replica_counts[1]"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=((1,), [2])), "replica_counts[1]"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=((1,), ())), "replica_counts[1]"),
        (dict(token_counts=(3, 3, 3), rank=0, replica_counts=((1, 2),) * 3), "2 parts per rank"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=((2, -1), (1, 1))), "replica_counts[0]"),
        (dict(token_counts=(1, 2), rank=0, replica_counts=((1, 1), (1, 1))), "replica_counts[0]"),
    ],
)
def test_layout_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        HeadLayout(**kwargs)


def _valid(counts, rank, parts) -> bool:
    """Independent statement of the validation rules."""

    def is_count(c):
        return type(c) is int and c >= 0

    if type(counts) is not tuple or not counts or not all(is_count(c) for c in counts):
        return False
    if type(rank) is not int or not 0 <= rank < len(counts):
        return False
    if parts is None:
        return True
    if type(parts) is not tuple or len(parts) != len(counts):
        return False
    if any(type(p) is not tuple or len(p) != len(parts[0]) or not p for p in parts):
        return False
    if len(counts) % len(parts[0]):
        return False
    return all(all(is_count(c) for c in p) and sum(p) == n for p, n in zip(parts, counts))


_count = st.one_of(st.integers(-1, 5), st.integers(0, 5), st.sampled_from([True, 1.0]))


@st.composite
def _layout_args(draw):
    n = draw(st.integers(0, 6))
    counts = [draw(st.integers(0, 6) if draw(st.booleans()) else _count) for _ in range(n)]
    counts = tuple(counts) if draw(st.integers(0, 9)) else counts
    rank = draw(st.one_of(st.integers(-1, 6), st.just(True)))
    if draw(st.booleans()):
        return counts, rank, None
    r = draw(st.sampled_from([1, 2, 3, 4]))
    parts = []
    for c in counts:
        if isinstance(c, int) and c >= 0 and draw(st.integers(0, 5)):
            cuts = sorted(draw(st.lists(st.integers(0, c), min_size=r - 1, max_size=r - 1)))
            bounds = [0, *cuts, c]
            parts.append(tuple(bounds[i + 1] - bounds[i] for i in range(r)))
        else:
            parts.append(tuple(draw(st.lists(_count, min_size=0, max_size=4))))
    if draw(st.integers(0, 9)) == 0:
        parts = parts[:-1]
    return counts, rank, tuple(parts)


@settings(max_examples=400, deadline=None)
@given(_layout_args())
def test_layout_validation_property(args):
    counts, rank, parts = args
    if not _valid(counts, rank, parts):
        with pytest.raises(ValueError):
            HeadLayout(counts, rank, parts)
        return
    lay = HeadLayout(counts, rank, parts)
    world = len(counts)
    r = 1 if parts is None else len(parts[0])
    shards = world // r
    assert (lay.world_size, lay.replicas, lay.shards) == (world, r, shards)
    all_parts = parts or tuple((n,) for n in counts)
    owned = tuple(all_parts[src][rank // shards] for src in range(world))
    assert lay.owned_counts == owned and lay.owned_tokens == sum(owned)
    assert lay.local_tokens == counts[rank] and lay.total_tokens == sum(counts)
    # sender and receiver agree: what `src` sends to `rank` is what `rank` expects from src
    for src in range(world):
        assert HeadLayout(counts, src, parts).send_counts[rank] == owned[src]
    # every token reaches exactly `shards` owners
    assert sum(HeadLayout(counts, o, parts).owned_tokens for o in range(world)) == (
        shards * sum(counts)
    )


# ---------------------------------------------------------------------------- replica parts


def test_replica_token_counts_golden():
    # hand-computed: balanced split of each rank, then whole tokens moved, rank 0 first
    assert replica_token_counts((4, 4, 4, 4), 2) == ((2, 2),) * 4
    assert replica_token_counts((5, 3, 3, 3), 2) == ((2, 3), (2, 1), (2, 1), (2, 1))
    assert replica_token_counts((5, 3, 3, 3), 2, "balanced") == ((1, 4), (2, 1), (2, 1), (2, 1))
    assert replica_token_counts((3, 0, 1, 6), 2) == ((0, 3), (0, 0), (0, 1), (3, 3))
    assert replica_token_counts((3, 0, 1, 6), 2, "balanced") == ((1, 2), (0, 0), (1, 0), (3, 3))
    assert replica_token_counts((1, 1, 1, 1), 2) == ((0, 1), (0, 1), (1, 0), (1, 0))
    assert replica_token_counts((0, 0, 0, 0), 2, "balanced") == ((0, 0),) * 4
    assert replica_token_counts((7, 2), 1) == ((7,), (2,))
    assert replica_token_counts((3, 0, 2, 1), 4) == ((1, 0, 2, 0), (0,) * 4, (1, 0, 0, 1),
                                                     (1, 0, 0, 0))  # fmt: skip


@pytest.mark.parametrize(
    "args, field",
    [
        (((2, 2, 2, 2), 0), "replicas"),
        (((2, 2, 2, 2), 3), "replicas"),
        (((2, 2, 2, 2), True), "replicas"),
        (((2, 2, 2, 2), 2.0), "replicas"),
        (((2, 2, 2, 2), 2, "even"), "policy"),
        (([2, 2], 2), "token_counts"),
        (((2, -2), 2), r"token_counts\[1\]"),
    ],
)
def test_replica_token_counts_rejects(args, field):
    with pytest.raises(ValueError, match=field):
        replica_token_counts(*args)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2),
                     (8, 4)]),  # fmt: skip
    st.data(),
    st.sampled_from(["run_totals", "balanced"]),
)
def test_replica_token_counts_property(world_r, data, policy):
    world, r = world_r
    counts = tuple(data.draw(st.lists(st.integers(0, 40), min_size=world, max_size=world)))
    parts = replica_token_counts(counts, r, policy)
    assert replica_token_counts(counts, r, policy) is parts  # cached
    assert len(parts) == world
    for p, n in zip(parts, counts):
        assert len(p) == r and all(type(c) is int and c >= 0 for c in p) and sum(p) == n
    totals = [sum(p[i] for p in parts) for i in range(r)]
    shards = world // r
    if policy == "run_totals":
        assert totals == [sum(counts[i * shards : (i + 1) * shards]) for i in range(r)]
    else:
        assert max(totals) - min(totals) <= 1
    HeadLayout(counts, 0, parts)  # a valid layout


# ---------------------------------------------------------------------------- workspace


def test_workspace_reuses_and_grows():
    ws = ExchangeWorkspace()
    a = ws.buffer("scatter_send", 10, torch.float32, torch.device("cpu"))
    b = ws.buffer("scatter_send", 8, torch.bfloat16, torch.device("cpu"))
    assert a.shape == (10,) and b.shape == (8,) and b.dtype == torch.bfloat16
    assert a.data_ptr() == b.data_ptr() and ws.nbytes == 40
    c = ws.buffer("scatter_send", 11, torch.float32, torch.device("cpu"))
    assert c.data_ptr() != a.data_ptr() and ws.nbytes == 44
    d = ws.buffer("gather_out", 1, torch.int64, torch.device("cpu"))
    assert d.data_ptr() != c.data_ptr() and ws.nbytes == 52
    ws.clear()
    assert ws.nbytes == 0


# ---------------------------------------------------------------------------- one rank


def test_world_of_one_returns_input_without_distributed():
    x = torch.arange(24.0).reshape(4, 2, 3).transpose(0, 0)
    lay = HeadLayout((4,), 0)
    with ref.CollectiveRecorder(forward=False) as rec:
        assert scatter_heads(x, None, lay) is x
        assert gather_heads(x, None, lay) is x
        assert gather_heads(x, None, HeadLayout((4,), 0, ((4,),))) is x
        assert ulysses_seq_to_heads(x, None, (4,)) is x
        assert ulysses_heads_to_seq(x, None, (4,)) is x
        qkv = x.unsqueeze(1).expand(4, 3, 2, 3)
        assert ulysses_qkv_to_heads(qkv, None, (4,)) is qkv
    assert rec.calls == []
    with pytest.raises(ValueError, match="x.shape"):
        scatter_heads(x[:3], None, lay)


# ---------------------------------------------------------------------------- fake group


class _FakeGroup:
    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


@pytest.fixture
def fake_dist(monkeypatch):
    """`get_world_size`/`get_rank` answer for `_FakeGroup`; every collective is recorded and
    not issued."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: group.rank)
    with ref.CollectiveRecorder(forward=False) as rec:
        yield rec


def test_acceptance_split_sizes_in_process(fake_dist):
    y = scatter_heads(torch.zeros(2, 6, 4), _FakeGroup(2, 0), HeadLayout((2, 5), 0))
    assert y.shape == (7, 3, 4)
    [(name, args, kwargs)] = fake_dist.calls
    assert name == "all_to_all_single"
    assert (args[0].shape, args[1].shape) == ((84,), (48,))
    assert (list(args[2]), list(args[3])) == ([24, 60], [24, 24])


def test_zero_tokens_issue_no_collective(fake_dist):
    g = _FakeGroup(4, 2)
    lay = HeadLayout((0, 0, 0, 0), 2, ((0, 0),) * 4)
    assert scatter_heads(torch.zeros(0, 12, 5), g, lay).shape == (0, 6, 5)
    assert gather_heads(torch.zeros(0, 6, 5), g, lay).shape == (0, 12, 5)
    assert ulysses_seq_to_heads(torch.zeros(0, 8, 5), g, (0,) * 4).shape == (0, 2, 5)
    assert ulysses_qkv_to_heads(torch.zeros(0, 3, 8, 5), g, (0,) * 4).shape == (0, 3, 2, 5)
    assert ulysses_heads_to_seq(torch.zeros(0, 2, 5), g, (0,) * 4).shape == (0, 8, 5)
    assert fake_dist.calls == []


_G4 = _FakeGroup(4, 1)
_L4 = HeadLayout((2, 3, 0, 1), 1)
_L4R = HeadLayout((2, 3, 0, 1), 1, ((1, 1), (2, 1), (0, 0), (0, 1)))
_BAD = {
    # name: (call, words the message must contain)
    "group size": (lambda: scatter_heads(torch.zeros(3, 4, 2), _FakeGroup(2, 1), _L4), "2 ranks"),
    "group rank": (lambda: scatter_heads(torch.zeros(3, 4, 2), _FakeGroup(4, 0), _L4), "rank 0"),
    "not a member": (lambda: scatter_heads(torch.zeros(3, 4, 2), _FakeGroup(4, -1), _L4), "-1"),
    "group None": (lambda: scatter_heads(torch.zeros(3, 4, 2), None, _L4), "world_size=4"),
    "layout type": (lambda: scatter_heads(torch.zeros(3, 4, 2), _G4, (2, 3, 0, 1)), "layout"),
    "x not tensor": (lambda: scatter_heads([[0.0]], _G4, _L4), "x must be a torch.Tensor"),
    "x 2-D": (lambda: scatter_heads(torch.zeros(3, 4), _G4, _L4), "x must have 3 dims"),
    "x 4-D": (lambda: scatter_heads(torch.zeros(3, 4, 2, 1), _G4, _L4), "x must have 3 dims"),
    "x dim0": (lambda: scatter_heads(torch.zeros(2, 4, 2), _G4, _L4), "x.shape[0]"),
    "x H zero": (lambda: scatter_heads(torch.zeros(3, 0, 2), _G4, _L4), "positive"),
    "x D zero": (lambda: scatter_heads(torch.zeros(3, 4, 0), _G4, _L4), "positive"),
    "x H % shards": (lambda: scatter_heads(torch.zeros(3, 6, 2), _G4, _L4), "6 heads"),
    "x H % shards rep": (lambda: scatter_heads(torch.zeros(3, 3, 2), _G4, _L4R), "shards=2"),
    "y dim0": (lambda: gather_heads(torch.zeros(5, 1, 2), _G4, _L4), "layout.owned_tokens=6"),
    "y dim0 rep": (lambda: gather_heads(torch.zeros(6, 1, 2), _G4, _L4R), "owned_tokens=3"),
    "y 2-D": (lambda: gather_heads(torch.zeros(6, 2), _G4, _L4), "y must have 3 dims"),
    "y D zero": (lambda: gather_heads(torch.zeros(6, 1, 0), _G4, _L4), "positive"),
    "u counts list": (lambda: ulysses_seq_to_heads(torch.zeros(3, 4, 2), _G4, [2, 3, 0, 1]),
                      "token_counts"),  # fmt: skip
    "u counts neg": (lambda: ulysses_seq_to_heads(torch.zeros(3, 4, 2), _G4, (2, 3, -1, 1)),
                     "token_counts[2]"),  # fmt: skip
    "u counts len": (lambda: ulysses_seq_to_heads(torch.zeros(3, 4, 2), _G4, (2, 3)), "4 ranks"),
    "u not a member": (lambda: ulysses_seq_to_heads(torch.zeros(3, 4, 2), _FakeGroup(4, -1),
                                                    (2, 3, 0, 1)), "-1"),  # fmt: skip
    "u None": (lambda: ulysses_seq_to_heads(torch.zeros(3, 4, 2), None, (2, 3, 0, 1)), "None"),
    "u dim0": (lambda: ulysses_seq_to_heads(torch.zeros(2, 4, 2), _G4, (2, 3, 0, 1)),
               "token_counts[1]=3"),  # fmt: skip
    "u H": (lambda: ulysses_seq_to_heads(torch.zeros(3, 6, 2), _G4, (2, 3, 0, 1)), "6 heads"),
    "u 4-D": (lambda: ulysses_seq_to_heads(torch.zeros(3, 3, 4, 2), _G4, (2, 3, 0, 1)), "3 dims"),
    "qkv 3-D": (lambda: ulysses_qkv_to_heads(torch.zeros(3, 4, 2), _G4, (2, 3, 0, 1)), "4 dims"),
    "qkv not 3": (lambda: ulysses_qkv_to_heads(torch.zeros(3, 2, 4, 2), _G4, (2, 3, 0, 1)),
                  "qkv.shape[1]"),  # fmt: skip
    "qkv H": (lambda: ulysses_qkv_to_heads(torch.zeros(3, 3, 6, 2), _G4, (2, 3, 0, 1)), "6 heads"),
    "u out dim0": (lambda: ulysses_heads_to_seq(torch.zeros(5, 1, 2), _G4, (2, 3, 0, 1)),
                   "sum(token_counts)=6"),  # fmt: skip
    "u out D": (lambda: ulysses_heads_to_seq(torch.zeros(6, 1, 0), _G4, (2, 3, 0, 1)),
                "positive"),  # fmt: skip
}


@pytest.mark.parametrize("name", list(_BAD))
def test_bad_input_raises_before_any_collective(fake_dist, name):
    call, words = _BAD[name]
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value)
    assert fake_dist.calls == []


def test_fake_group_good_calls_issue_one_collective_each(fake_dist):
    """The fake group is not vacuous: the same calls with good input reach the collective."""
    scatter_heads(torch.zeros(3, 4, 2), _G4, _L4)
    gather_heads(torch.zeros(6, 1, 2), _G4, _L4)
    scatter_heads(torch.zeros(3, 4, 2).transpose(0, 0), _G4, _L4R)
    ulysses_seq_to_heads(torch.zeros(3, 4, 2), _G4, (2, 3, 0, 1))
    ulysses_qkv_to_heads(torch.zeros(3, 3, 4, 2), _G4, (2, 3, 0, 1))
    ulysses_heads_to_seq(torch.zeros(6, 1, 2), _G4, (2, 3, 0, 1))
    assert [c[0] for c in fake_dist.calls] == ["all_to_all_single"] * 6
    # the replicated layout splits rank 1's 3 tokens into parts (2, 1): 4 elements per
    # token and owner; rank 1 (part 0, shard 1) receives part 0 of every rank
    _, args, _ = fake_dist.calls[2]
    assert list(args[3]) == [8, 8, 4, 4] and list(args[2]) == [4, 8, 0, 0]
