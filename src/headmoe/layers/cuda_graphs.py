"""CUDA-graph capture of a step that has no host sync, applied from outside the model
(docs/model.md, "CUDA graphs").

`GraphedStep(fn)` wraps a function of tensors that returns a tensor or a tuple of tensors.
The first call with a given key (each input's shape, dtype, device and stride) warms the
function up on a side stream, copies the inputs into static buffers of that key and
captures one `torch.cuda.CUDAGraph` of ``fn`` on those buffers; later calls with the same
key copy their inputs into the buffers, replay the graph and return clones of its static
outputs. Replay launches the same kernels on the same addresses as the captured call, so
the outputs are the eager ones bit for bit wherever ``fn``'s kernels are deterministic (no
atomics: headmoe's Triton kernels and batch-invariant ops are).

A key not captured (``max_graphs`` reached, or ``capture=False`` for that call) runs
eagerly. A function that syncs with the host during capture (a ``.tolist()``, ``.item()``
or a device-to-host copy: CUDA refuses those in a capture) makes the capture fail; the key
is then marked eager and `GraphedStep.refused` records why, so a step with host syncs runs
as before instead of failing. The graph class is a parameter (tests pass a recording
stand-in: a CPU machine cannot capture).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: the flag and the default number of shapes one wrapper captures
FLAG = "--cuda-graphs"
MAX_GRAPHS = 8

Key = tuple[tuple[tuple[int, ...], torch.dtype, str, tuple[int, ...]], ...]


def key_of(inputs: tuple[torch.Tensor, ...]) -> Key:
    """The capture key of ``inputs``: each tensor's (shape, dtype, device, stride)."""
    return tuple((tuple(t.shape), t.dtype, str(t.device), tuple(t.stride())) for t in inputs)


def check_cuda_graphs(on: bool, device: str, offload_layers: bool = False,
                      world_size: int = 1) -> None:  # fmt: skip
    """Refuse ``--cuda-graphs`` (before any rank starts) where a capture of the denoise step
    cannot run: a rank device other than CUDA, layer streaming (host-ordered slot copies),
    more than one rank (collectives in a graph need NCCL's graph support and the exchange
    timeouts' watchdog reviewed), and, until the forward's inputs live in static device
    buffers (docs/model.md, "CUDA graphs"), the transformer forward itself: only
    `GraphedStep` on sync-free steps (benchmarks/gpu_check.py section k) captures today.
    Raises `ValueError` naming the flag and the value that refuses it."""
    if not on:
        return
    if device != "cuda":
        raise ValueError(f"{FLAG} needs CUDA ranks; the ranks run on device={device!r} "
                         "(leave the flag out on a CPU)")
    if offload_layers:
        raise ValueError(f"{FLAG} cannot capture --offload-layers (its slot copies are "
                         "ordered by the host each step); use one or the other")
    if world_size != 1:
        raise ValueError(f"{FLAG} captures one rank only; world_size={world_size} "
                         "(collectives inside a graph are not reviewed)")
    raise ValueError(f"{FLAG}: the transformer forward copies its inputs from the host each "
                     "step (docs/model.md, 'CUDA graphs'), so it is not captured yet on "
                     f"device={device!r}; benchmarks/gpu_check.py section k measures the "
                     "capture of a sync-free step")


@dataclasses.dataclass
class _Captured:
    """One captured key: its graph, static inputs and static outputs."""

    graph: Any
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    single: bool


class GraphedStep:
    """``fn`` captured per input key, replayed on later calls of the key (module doc).

    fn: tensors -> tensor or tuple of tensors (any shapes and dtypes, on one CUDA device).
    graph_cls, graph_context, stream_cls: `torch.cuda.CUDAGraph`, `torch.cuda.graph` and
    `torch.cuda.Stream` by default; `stand_in()` gives CPU stand-ins (tests, dry runs).
    """

    def __init__(self, fn: Callable[..., Any], *, max_graphs: int = MAX_GRAPHS,
                 graph_cls: Callable[[], Any] | None = None,
                 graph_context: Callable[[Any, Any], Any] | None = None,
                 stream_cls: Callable[[], Any] | None = None, warmup: int = 2,
                 on_captured: Callable[..., None] | None = None) -> None:  # fmt: skip
        self.fn = fn
        self.max_graphs = max_graphs
        self.graph_cls = graph_cls or torch.cuda.CUDAGraph
        self.graph_context = graph_context or (lambda g, s: torch.cuda.graph(g, stream=s))
        self.stream_cls = stream_cls or torch.cuda.Stream
        self.warmup = warmup
        self.on_captured = on_captured
        self.graphs: dict[Key, _Captured] = {}
        self.refused: dict[Key, str] = {}
        self.replays = 0
        self.eager_calls = 0

    def __call__(self, *inputs: torch.Tensor, capture: bool = True) -> Any:
        key = key_of(inputs)
        done = self.graphs.get(key)
        if done is None and capture and key not in self.refused and \
                len(self.graphs) < self.max_graphs:  # fmt: skip
            done = self._capture(key, inputs)
        if done is None:
            self.eager_calls += 1
            return self.fn(*inputs)
        for static, t in zip(done.inputs, inputs):
            static.copy_(t)
        done.graph.replay()
        self.replays += 1
        out = tuple(t.clone() for t in done.outputs)
        return out[0] if done.single else out

    def _capture(self, key: Key, inputs: tuple[torch.Tensor, ...]) -> _Captured | None:
        """Warm up on a side stream, capture on static copies of ``inputs``; None (and
        ``refused[key]``) when the capture fails (a host sync in ``fn``)."""
        static = tuple(t.clone() for t in inputs)
        stream = self.stream_cls()
        current = _current_stream(static)
        if current is not None:
            stream.wait_stream(current)
        with _on_stream(stream):
            for _ in range(self.warmup):
                self.fn(*static)
        if current is not None:
            current.wait_stream(stream)
        graph = self.graph_cls()
        try:
            with self.graph_context(graph, stream):
                out = self.fn(*static)
        except RuntimeError as e:  # CUDA: "operation not permitted when stream is capturing"
            self.refused[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return None
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else tuple(out)
        done = _Captured(graph, static, outputs, single)
        if self.on_captured is not None:
            self.on_captured(graph, self.fn, static, outputs)
        self.graphs[key] = done
        return done


class StandInGraph:
    """A CPU stand-in for `torch.cuda.CUDAGraph`: `replay` re-runs the captured call on
    the static inputs and writes the static outputs in place (as a graph's replay does);
    ``capturing`` is True inside the capture, so a test's host sync can refuse like CUDA."""

    capturing = False

    def __init__(self) -> None:
        self.replays = 0
        self._body: Callable[[], None] | None = None

    def bind(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...],
             outputs: tuple[torch.Tensor, ...]) -> None:  # fmt: skip
        def body() -> None:
            out = fn(*inputs)
            for static, t in zip(outputs, (out,) if isinstance(out, torch.Tensor) else out):
                static.copy_(t)
        self._body = body

    def replay(self) -> None:
        if self._body is None:
            raise RuntimeError("StandInGraph.replay before a capture")
        self.replays += 1
        self._body()


@contextlib.contextmanager
def _stand_in_capture(graph: StandInGraph, stream: Any) -> Iterator[None]:
    StandInGraph.capturing = True
    try:
        yield
    finally:
        StandInGraph.capturing = False


class _NoStream:
    """The stand-in's side stream (nothing to order on a CPU)."""


def stand_in() -> dict[str, Any]:
    """`GraphedStep` keyword arguments that capture with `StandInGraph` on a CPU."""
    return {"graph_cls": StandInGraph, "graph_context": _stand_in_capture,
            "stream_cls": _NoStream,
            "on_captured": lambda g, fn, i, o: g.bind(fn, i, o)}  # fmt: skip


def _current_stream(inputs: tuple[torch.Tensor, ...]) -> Any:
    """The current CUDA stream of the inputs' device (None off CUDA: the stand-in path)."""
    if inputs and inputs[0].is_cuda:
        return torch.cuda.current_stream(inputs[0].device)
    return None


def _on_stream(stream: Any) -> Any:
    """`torch.cuda.stream(stream)` for a CUDA stream, else a no-op context."""
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()
