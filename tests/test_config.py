import pytest

from headmoe.config import ParallelConfig


@pytest.mark.parametrize("value", [0, -1, True, "2", 2.5])
def test_expert_parallel_size_must_be_positive_int(value):
    with pytest.raises(ValueError, match=rf"expert_parallel_size.*{value!r}"):
        ParallelConfig(enable_expert_parallel=True, expert_parallel_size=value)


def test_expert_parallel_size_requires_enable():
    with pytest.raises(ValueError, match="expert_parallel_size=2 requires enable_expert_parallel"):
        ParallelConfig(expert_parallel_size=2)


@pytest.mark.parametrize(
    "field", ["ulysses_degree", "cfg_parallel_size", "data_parallel_size"]
)
@pytest.mark.parametrize("value", [0, -1, True, "2", 2.5, None])
def test_sizes_must_be_positive_ints(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a positive int, got {value!r}"):
        ParallelConfig(**{field: value})


def test_moe_exchange_values():
    for ok in ("auto", "ep_group", "sp_group"):
        assert ParallelConfig(moe_exchange=ok).moe_exchange == ok
    with pytest.raises(ValueError, match="moe_exchange must be one of .* got 'ep'"):
        ParallelConfig(moe_exchange="ep")
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool, got 1"):
        ParallelConfig(enable_expert_parallel=1)


def test_world_size_ignores_ep():
    c = ParallelConfig(
        ulysses_degree=4,
        cfg_parallel_size=2,
        data_parallel_size=3,
        enable_expert_parallel=True,
        expert_parallel_size=2,
    )
    assert c.world_size == 24
    assert c.sequence_parallel_size == 4


def test_dict_round_trip():
    c = ParallelConfig(
        ulysses_degree=8, enable_expert_parallel=True, expert_parallel_size=4, moe_exchange="sp_group"
    )
    d = c.to_dict()
    assert d["expert_parallel_size"] == 4 and d["moe_exchange"] == "sp_group"
    assert ParallelConfig.from_dict(d) == c
    assert ParallelConfig.from_dict(ParallelConfig().to_dict()) == ParallelConfig()
    with pytest.raises(ValueError, match="unknown ParallelConfig field.*ep_size"):
        ParallelConfig.from_dict({"ep_size": 2})


def test_frozen():
    c = ParallelConfig()
    with pytest.raises(AttributeError):
        c.ulysses_degree = 2  # type: ignore[misc]


def test_ep_rules():
    for ep in (3, 8):
        with pytest.raises(ValueError, match=f"expert_parallel_size={ep} must divide "
                                             "ulysses_degree=4"):
            ParallelConfig(ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=ep)
    c = ParallelConfig(ulysses_degree=2, enable_expert_parallel=True, expert_parallel_size=2)
    assert c.resolved_expert_parallel_size() == 2
    assert ParallelConfig(ulysses_degree=8).resolved_expert_parallel_size() == 8
    # the TP axis and the "standard" EP style are gone: no model used them
    with pytest.raises(ValueError, match="unknown ParallelConfig field.*tensor_parallel_size"):
        ParallelConfig.from_dict({"tensor_parallel_size": 1})
