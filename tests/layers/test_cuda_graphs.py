"""`headmoe.layers.cuda_graphs` on a CPU, with the recording stand-in graph: static buffers
keyed by shape, replays equal to eager calls, eager fallback for shapes not captured, a
capture refused by a host sync, and `--cuda-graphs`' refusals (before any rank starts)."""

import pytest
import torch

from headmoe.layers import cuda_graphs as cg


def _step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x @ w)
    return h, h.sum(-1)


def test_replay_equals_eager_and_reuses_the_static_buffers():
    step = cg.GraphedStep(_step, **cg.stand_in())
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 5, generator=g)
    x1, x2 = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    first = step(x1, w)
    (key,) = step.graphs
    buffers = [t.data_ptr() for t in step.graphs[key].inputs]
    second = step(x2, w)
    assert all(torch.equal(a, b) for a, b in zip(first, _step(x1, w)))
    assert all(torch.equal(a, b) for a, b in zip(second, _step(x2, w)))
    assert step.replays == 2 and step.eager_calls == 0 and len(step.graphs) == 1
    assert [t.data_ptr() for t in step.graphs[key].inputs] == buffers
    assert step.graphs[key].graph.replays == 2
    # the outputs returned are copies: a later replay does not change them
    keep = second[0].clone()
    step(x1, w)
    assert torch.equal(second[0], keep)


def test_one_graph_per_key_and_eager_past_the_limit_or_when_told():
    step = cg.GraphedStep(lambda x: x * 2, max_graphs=2, **cg.stand_in())
    for n in (3, 4, 3, 4):
        assert torch.equal(step(torch.arange(n, dtype=torch.float32)),
                           2 * torch.arange(n, dtype=torch.float32))  # fmt: skip
    assert len(step.graphs) == 2 and step.replays == 4 and step.eager_calls == 0
    assert torch.equal(step(torch.ones(5)), 2 * torch.ones(5))  # a third shape: eager
    assert torch.equal(step(torch.ones(6), capture=False), 2 * torch.ones(6))
    assert step.eager_calls == 2 and len(step.graphs) == 2
    # dtype and stride are part of the key
    assert cg.key_of((torch.ones(3),)) != cg.key_of((torch.ones(3, dtype=torch.float64),))
    t = torch.ones(4, 4)
    assert cg.key_of((t,)) != cg.key_of((t.t(),))


def test_a_host_sync_refuses_the_capture_and_the_step_runs_eagerly():
    def syncs(x: torch.Tensor) -> torch.Tensor:
        if cg.StandInGraph.capturing:  # what CUDA answers to a .tolist() in a capture
            raise RuntimeError("operation not permitted when stream is capturing")
        n = int(x.sum().item())
        return x + n

    step = cg.GraphedStep(syncs, **cg.stand_in())
    x = torch.ones(3)
    assert torch.equal(step(x), x + 3) and torch.equal(step(2 * x), 2 * x + 6)
    assert not step.graphs and step.replays == 0 and step.eager_calls == 2
    assert list(step.refused.values()) == [
        "RuntimeError: operation not permitted when stream is capturing"]
    assert not cg.StandInGraph.capturing


def test_replay_before_capture_is_an_error():
    with pytest.raises(RuntimeError, match="before a capture"):
        cg.StandInGraph().replay()


@pytest.mark.parametrize("kw, words", [
    ({"device": "cpu"}, "needs CUDA ranks; the ranks run on device='cpu'"),
    ({"device": "cuda", "offload_layers": True}, "cannot capture --offload-layers"),
    ({"device": "cuda", "world_size": 2}, "world_size=2"),
    ({"device": "cuda"}, "not captured yet on device='cuda'"),
])  # fmt: skip
def test_the_flag_is_refused_by_name(kw, words):
    cg.check_cuda_graphs(False, **kw)  # off: nothing to check
    with pytest.raises(ValueError, match="--cuda-graphs") as e:
        cg.check_cuda_graphs(True, **kw)
    assert words in str(e.value)
