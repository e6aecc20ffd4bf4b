"""`headmoe.pipeline.stop.LayerGate`: every rank stops before the same layer (issue 31 point 2,
issue 32 point 4 for many ranks): a cancel on one rank, or a streamed layer read that fails
on one rank only, stops all of them there, and no rank waits in the layer's exchange for the
collective timeout."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from headmoe.pipeline.stop import CANCEL, FAILED, GO_ON, LayerGate, StopAtLayer
from headmoe.testing import RankFailure, run_ranks

#: the layer (0-based) before which the stop happens, and how many a forward has
STOP_AT, LAYERS = 2, 4
#: the group timeout of the spawned test: a rank left waiting would hit it
GROUP_TIMEOUT_S = 30.0


class Exchanging(nn.Module):
    """A layer whose forward is a collective (an all-reduce), as a layer's exchanges are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.all_reduce(x)
        return x + 1


class FailingStreamer:
    """A layer streamer whose read of layer ``fail_at`` fails (None: never), as a changed
    checkpoint file makes it (`LayerStreamer.ready`)."""

    def __init__(self, layers: nn.ModuleList, fail_at: int | None):
        self.layers, self.fail_at, self.read = list(layers), fail_at, []

    def ready(self, layer: nn.Module) -> None:
        index = self.layers.index(layer)
        self.read.append(index)
        if index == self.fail_at:
            raise RuntimeError(f"checkpoint file 'shard.safetensors' changed (layer {index})")


def _parts(fail_at: int | None = None) -> SimpleNamespace:
    model = nn.Module()
    model.block = nn.Module()
    model.block.layers = nn.ModuleList(Exchanging() for _ in range(LAYERS))
    model.streamer = FailingStreamer(model.block.layers, fail_at)
    return SimpleNamespace(denoiser=SimpleNamespace(model=model), refiner=None)


def _forward(parts: SimpleNamespace) -> torch.Tensor:
    x = torch.zeros(1)
    for layer in parts.denoiser.model.block.layers:
        x = layer(x)
    return x


def test_one_rank_cancel_stops_before_the_layer_and_the_gate_leaves_no_hook():
    parts = _parts()
    gate = LayerGate(parts, None, lambda: CANCEL if gate.layers >= STOP_AT else GO_ON)
    with pytest.raises(StopAtLayer) as stop, gate:
        _forward(parts)
    assert stop.value.code == CANCEL and stop.value.layer == STOP_AT
    assert parts.denoiser.model.streamer.read == [0, 1, 2]  # read before the agreement
    assert torch.equal(_forward(parts), torch.full((1,), float(LAYERS)))  # hooks removed


def _one_rank_fails_its_read(rank: int, world: int) -> dict:
    parts = _parts(fail_at=STOP_AT if rank == 1 else None)
    t0 = time.monotonic()
    try:
        with LayerGate(parts, None):
            _forward(parts)
    except StopAtLayer as exc:
        return {"kind": "stop", "code": exc.code, "layer": exc.layer,
                "s": time.monotonic() - t0, "text": str(exc)}
    except RuntimeError as exc:
        return {"kind": "error", "text": str(exc), "s": time.monotonic() - t0,
                "read": parts.denoiser.model.streamer.read}
    return {"kind": "finished"}


@pytest.mark.multirank
def test_a_read_failing_on_one_rank_stops_both_at_that_layer():
    try:
        rank0, rank1 = run_ranks(_one_rank_fails_its_read, 2, timeout=GROUP_TIMEOUT_S + 60)
    except RankFailure as exc:  # a rank left in the layer's all-reduce: the bug
        pytest.fail(f"a rank did not stop with the other: {exc}")
    assert rank1["kind"] == "error" and "shard.safetensors" in rank1["text"], rank1
    assert rank0["kind"] == "stop" and rank0["code"] == FAILED, rank0
    assert rank0["layer"] == STOP_AT and rank1["read"] == [0, 1, 2], (rank0, rank1)
    assert "stopped with every rank" in rank0["text"]  # named last (`failure_order`)
    assert max(rank0["s"], rank1["s"]) < GROUP_TIMEOUT_S / 3, (rank0, rank1)
