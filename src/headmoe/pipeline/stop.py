"""Stopping a job between two transformer layers, every rank at the same one.

The one home of the mechanism `serve` (DELETE, the drain bound) and a streamed layer whose
checkpoint changed (`--offload-layers`, `generate` and `serve`) share:

    with LayerGate(parts, device, local):     # every rank, around the job's forwards
        run_request(...)

Before every transformer layer of the job (the preview's and the refiner's: a forward
pre-hook put first, so it runs before the layer streamer's weight read), each rank

1. asks ``local()`` for its own stop code (0: go on; `CANCEL`: serve's rank 0);
2. waits for the layer's streamed weights (`LayerStreamer.ready`): an error of that read
   (`CheckpointChanged`: a shard truncated or rewritten in place) is code `FAILED`;
3. all-reduces the largest code over the world (one int64 ``MAX`` all-reduce, bounded by
   the group's timeout; nothing with one rank), so every rank sees the same code at the
   same layer and none is left waiting in the layer's exchanges for a rank that stopped.

A code stops every rank there: the rank whose read failed raises that error, the others
`StopAtLayer`. A stop therefore waits for at most one layer, however long a step is.

`generate`'s Ctrl-C and SIGTERM do not wait for a layer: every rank gets the signal
(`headmoe.distributed.launch` forwards it as SIGINT) and raises at its next Python line,
i.e. after the torch op running then, which is sooner than the next layer (measured at
448x256, 29 frames: 6-8 s against 16-20 s through a gate, docs/guide.md); the job ends on
every rank, so nothing needs the ranks in step. `run_job` enters a gate only where layers
stream, for the changed-checkpoint stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from headmoe.distributed.launch import PEER_STOPPED
from headmoe.pipeline.interfaces import Components

#: stop codes, the largest wins: go on, a cancel (serve: DELETE or the drain bound), a
#: rank's streamed layer read failed
GO_ON, CANCEL, FAILED = 0, 1, 64


class StopAtLayer(Exception):
    """Every rank stopped before the same layer: ``code`` (`CANCEL`, or `FAILED`: another
    rank's layer read failed), ``layer`` (the layers this gate saw run)."""

    def __init__(self, code: int, layer: int):
        self.code, self.layer = code, layer
        why = "another rank's read of a streamed layer failed" if code == FAILED else "a cancel"
        super().__init__(f"{PEER_STOPPED} before layer call {layer + 1} ({why})")


def agree(code: int, device: torch.device | None) -> int:
    """The largest ``code`` of every rank of the world (one all-reduce; ``code`` itself in
    a world of one rank)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return code
    t = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gated_models(parts: Components) -> list[tuple[nn.Module, Any]]:
    """(transformer, its layer streamer or None) of ``parts``: the preview's, the
    refiner's (where the job has one)."""
    out = []
    for holder in (parts.denoiser, parts.refiner):
        model = getattr(holder, "model", None)
        if model is not None and getattr(model, "block", None) is not None:
            out.append((model, getattr(model, "streamer", None)))
    return out


def streams_layers(parts: Components) -> bool:
    """Whether a transformer of ``parts`` streams its layers (`--offload-layers`)."""
    return any(streamer is not None for _, streamer in gated_models(parts))


def gated_layers(parts: Components) -> list[tuple[nn.Module, Any]]:
    """(layer module, its streamer or None) for every transformer layer ``parts`` runs: the
    preview's ``block.layers``, then the refiner's."""
    blocks: list[tuple[Any, Any]] = [(m.block, st) for m, st in gated_models(parts)]
    return [(layer, streamer) for block, streamer in blocks for layer in block.layers]


class LayerGate:
    """The check before every layer (module docstring) while the ``with`` block runs.
    ``local() -> int``: this rank's stop code (serve: rank 0's cancel or drain bound)."""

    def __init__(self, parts: Components, device: torch.device | None,
                 local: Callable[[], int] = lambda: GO_ON):
        self.parts, self.device, self.local = parts, device, local
        self.layers = 0
        self._handles: list[Any] = []

    def __enter__(self) -> LayerGate:
        for layer, streamer in gated_layers(self.parts):
            hook = self._hook(streamer)
            self._handles.append(layer.register_forward_pre_hook(hook, prepend=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, streamer: Any) -> Callable[..., None]:
        return lambda module, args: self.check(module, streamer)

    def check(self, module: nn.Module, streamer: Any = None) -> None:
        """Before ``module`` runs: agree on a stop with every rank; raise if there is one."""
        code, error = self.local(), None
        if streamer is not None:
            try:
                streamer.ready(module)
            except Exception as exc:  # noqa: BLE001 - every rank stops, this one with it
                code, error = FAILED, exc
        code = agree(code, self.device)
        seen, self.layers = self.layers, self.layers + 1
        if code == GO_ON:
            return
        if error is not None:
            raise error
        raise StopAtLayer(code, seen)
