"""Layer streaming (`--offload-layers`, issue 20): a model's layers hold no weights of their
own; at most `slots` layers' weights exist at a time, each read from the checkpoint's
safetensors files (read with ``pread``, never mapped) into a slot buffer just before the layer runs and released
after it. Output bytes are those of the resident model (the slot holds the same values, cast
the same way; docs/guide.md "Fewer GPUs").

Generic over a list of layer modules (MAGI-2's `block.layers`, the refiner's layers): what a
layer reads is a list of `TensorRead`s (its tensor, the stored checkpoint name, the stored
rows this rank holds), built by the model family (`headmoe.models.magi2.loading.
stream_layers`). `LayerStreamer` attaches to the layers with forward hooks, so a model
whose loop calls its layers (both families: `headmoe.models.common.PlannedModel`) is
unchanged.

Data path of one streamed layer on one rank:

    safetensors file --pread from the descriptor opened once (its identity checked before
    and after: `MappedCheckpoint`); the page cache holds one copy per node, shared by every
    rank--> this rank's rows, in chunks of `CHUNK_BYTES` through one chunk buffer
    --copy, cast to the parameter dtype--> host slot (pinned memory on CUDA)
    --CUDA only: copy stream, non_blocking, then an event--> device slot
    the layer's parameters are views of the slot while it runs; then placeholders again

A worker thread fills slot `p % slots` with the layer at position p of the streamed order
while earlier layers compute; after the last layer it goes on with the first layers of the
next forward. On CUDA the copy stream waits for the event the compute stream records when
the slot's previous layer released it, and the compute stream waits for the fill's event
before the layer runs. On CPU the host slot is the device slot (so the path is tested
without a GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from headmoe.config import is_int
from headmoe.distributed.context import ParallelContext
from headmoe.errors import RuntimeFault

#: layers' weights on the device at once by default (the layer running and the next one)
DEFAULT_SLOTS = 2
#: byte alignment of every tensor inside a slot (the CUDA caching allocator's, >= CPU's 64)
SLOT_ALIGN = 512
#: bytes copied per chunk from a mapped file before the chunk's mapping is dropped
CHUNK_BYTES = 32 << 20
#: largest safetensors header read (the format's own reader refuses larger ones)
MAX_HEADER_BYTES = 100 << 20
#: safetensors dtype names of the float types a checkpoint may store
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 routed experts (docs/fp8.md); never cast
}


# ---------------------------------------------------------------------- what a layer reads
@dataclass(frozen=True)
class TensorRead:
    """One tensor of a streamed layer: `name` relative to the layer module (for example
    "mlp.moe_mlp.W_gate"), `key` the stored checkpoint name whose values it takes, and
    `rows` `(start, stop)`: the stored rows this rank reads (None: the whole tensor). The
    local tensor (shape and dtype of the module's parameter or buffer) holds those rows
    first, then zero rows."""

    name: str
    key: str
    rows: tuple[int, int] | None = None


def split_layers(num_layers: int, resident_layers: int) -> tuple[range, range]:
    """`(resident, streamed)` layer ids: the first `resident_layers` layers stay on the
    device, the others stream. Raises `ValueError` naming `resident_layers`."""
    if not is_int(resident_layers) or not 0 <= resident_layers <= num_layers:
        raise ValueError(f"resident_layers must be an int in [0, {num_layers}] (the model's "
                         f"layers), got {resident_layers!r}")
    return range(resident_layers), range(resident_layers, num_layers)


def check_slots(slots: object) -> int:
    """`slots` if it is an int >= 1, else `ValueError` naming it."""
    if not is_int(slots) or slots < 1:
        raise ValueError(f"slots (layers in flight) must be an int >= 1, got {slots!r}")
    return slots


def _aligned(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def slot_layout(tensors: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]]
                ) -> tuple[list[int], int]:
    """Byte offsets of `tensors` (shape, dtype) packed in one slot (each `SLOT_ALIGN`-byte
    aligned) and the slot bytes they need. The one rule the runtime and the planner share."""
    offsets, total = [], 0
    for shape, dtype in tensors:
        offsets.append(total)
        total += _aligned(torch.Size(shape).numel() * dtype.itemsize)
    return offsets, total


def local_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` (dotted, relative to `layer`)."""
    mod, _, attr = name.rpartition(".")
    owner = layer.get_submodule(mod)
    if attr in owner._parameters:
        return cast(torch.Tensor, owner._parameters[attr])  # a registered parameter
    return owner.get_buffer(attr)


def layer_tensors(layer: nn.Module, reads: Sequence[TensorRead]
                  ) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each read's local tensor in `layer` (meta or real)."""
    return [(t.shape, t.dtype) for t in (local_tensor(layer, r.name) for r in reads)]


# ---------------------------------------------------------------------- mapped files
@dataclass(frozen=True)
class StoredTensor:
    """A tensor's place in a safetensors file: bytes `[begin, end)` of the file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str) -> dict[str, StoredTensor]:
    """Every float tensor of a safetensors file from its header (8-byte little-endian
    header length, JSON header, data). Raises `ValueError` naming the file for a header that
    is too large, unreadable, or places a tensor outside the file or at a wrong size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path!r}: safetensors header length {n} is not in "
                             f"(0, {min(MAX_HEADER_BYTES, size - 8)}]")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path!r}: safetensors header is not JSON: {e}") from None
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        dtype = FLOAT_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            continue  # the model's own checks refuse non-float tensors it needs
        begin, end = (8 + n + int(o) for o in meta["data_offsets"])
        shape = tuple(int(s) for s in meta["shape"])
        if not 8 + n <= begin <= end <= size or end - begin != torch.Size(shape).numel() * (
            dtype.itemsize
        ):
            raise ValueError(f"{path!r}: tensor {key!r} {list(shape)} {meta['dtype']} has data "
                             f"offsets {meta['data_offsets']} outside the file or of the wrong "
                             "size")
        out[key] = StoredTensor(path, dtype, shape, begin, end)
    return out


class CheckpointChanged(RuntimeFault):
    """A checkpoint file changed (size, modification time, inode) while a run read it."""


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class MappedCheckpoint:
    """The safetensors files of a checkpoint, each opened once and read with ``pread``
    (through the page cache, which every process of the node shares; no mapping, so a file
    truncated under a run cannot raise SIGBUS).

    Each file's identity (device, inode, size, modification and change times) is recorded
    when it is opened here, with its header; every read checks it before and after, both
    on the open descriptor and on the path, and raises `CheckpointChanged` naming the file
    if anything differs, so a run never goes on with weights from two versions of a file.

    `files` maps stored names to their file. `read_into` copies a `TensorRead`'s rows into a
    destination tensor. `read_bytes` counts the bytes read and `read_ranges[key]` the lowest
    and highest byte (relative to the tensor's data) read of each tensor, so a test can see
    that a rank never touches rows outside its shard."""

    def __init__(self, files: dict[str, str]):
        self._entries: dict[str, StoredTensor] = {}
        self._fds: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        try:
            for file in sorted(set(files.values())):
                fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds[file] = (fd, _identity(os.fstat(fd)))
                header = read_header(file)
                self._entries.update({k: header[k] for k, f in files.items() if f == file
                                      and k in header})
        except BaseException:
            self.close()
            raise
        self.read_bytes = 0
        self.read_ranges: dict[str, tuple[int, int]] = {}

    def stored(self, key: str) -> StoredTensor:
        if key not in self._entries:
            raise ValueError(f"checkpoint tensor {key!r} is not a float tensor of the mapped "
                             "files")
        return self._entries[key]

    def _check(self, file: str) -> int:
        """The descriptor of ``file``, after checking that neither it nor the path changed."""
        fd, known = self._fds[file]
        try:
            now = [_identity(os.fstat(fd)), _identity(os.stat(file))]
        except OSError as e:
            raise CheckpointChanged(f"checkpoint file {file!r} cannot be read any more "
                                    f"({e.strerror}); the run stopped") from None
        if any(n != known for n in now):
            raise CheckpointChanged(
                f"checkpoint file {file!r} changed after headmoe opened it to stream its "
                "layers (size, time or inode differ); the run stopped so that no output mixes "
                "two versions of the weights: restart headmoe with the checkpoint unchanged")
        return fd

    def read_into(self, read: TensorRead, dst: torch.Tensor) -> None:
        """Copy the stored rows of `read` into `dst` (a contiguous CPU tensor of the local
        shape, any float dtype: values are cast as `Tensor.to` casts), then zero the rows
        after them. Only the bytes of those rows are read."""
        st = self.stored(read.key)
        start, stop = read.rows if read.rows is not None else (0, st.shape[0] if st.shape else 1)
        row_bytes = (st.end - st.begin) // max(st.shape[0], 1) if st.shape else st.end - st.begin
        lo, hi = start * row_bytes, stop * row_bytes
        if not 0 <= lo <= hi <= st.end - st.begin or dst.numel() * st.dtype.itemsize < hi - lo:
            raise ValueError(f"{read.key}: rows {start}..{stop} do not fit the stored "
                             f"{list(st.shape)} or the local {list(dst.shape)}")
        flat = dst.view(-1)
        item = st.dtype.itemsize
        step = max(CHUNK_BYTES // item, 1) * item
        fd = self._check(st.file)
        buf = torch.empty(min(step, hi - lo), dtype=torch.uint8)
        for off in range(lo, hi, step):
            n = min(step, hi - off)
            # a numpy view is a writable buffer; numpy's stubs do not say so to os.preadv
            got = os.preadv(fd, [buf[:n].numpy()], st.begin + off)  # type: ignore[list-item]
            if got != n:
                self._check(st.file)  # names the change; else the file is short
                raise CheckpointChanged(f"checkpoint file {st.file!r} ended early reading "
                                        f"{read.key}; the run stopped")
            flat[(off - lo) // item : (off - lo + n) // item].copy_(buf[:n].view(st.dtype))
        self._check(st.file)  # a write during the copy shows in the times
        flat[(hi - lo) // item :].zero_()
        with self._lock:
            self.read_bytes += hi - lo
            old = self.read_ranges.get(read.key, (lo, hi))
            self.read_ranges[read.key] = (min(old[0], lo), max(old[1], hi))

    def close(self) -> None:
        """Close the files."""
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def layer_index(name: str) -> int | None:
    """i of a `block.layers.{i}.` tensor name (the layer list of both MAGI-2 models; None
    for other names)."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["block", "layers"] and parts[2].isdigit() else None


def whole_reads(layer: nn.Module, key_prefix: str) -> list[TensorRead]:
    """A `TensorRead` of every parameter and buffer of `layer`, whole, from the stored
    tensor `key_prefix + name` (a layer every rank holds entirely)."""
    return [TensorRead(n, key_prefix + n)
            for n, _ in [*layer.named_parameters(), *layer.named_buffers()]]


# ---------------------------------------------------------------------- placeholders
def materialise_except(root: nn.Module, skip: Sequence[nn.Module], device: torch.device
                       ) -> None:
    """Give every meta parameter and buffer of `root` outside the modules `skip` an
    (uninitialised) tensor on `device`; the modules in `skip` keep their meta placeholders.
    Load the values afterwards (every persistent tensor must come from the checkpoint)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    for module in root.modules():
        if id(module) in skipped:
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)


def attach_streamer(
    model: nn.Module, layers: Sequence[nn.Module] | nn.ModuleList, streamed: Sequence[int],
    load: Callable[[Callable[[str], bool]], object], reads: Callable[[int], list[TensorRead]],
    files: dict[str, str], context: ParallelContext, slots: int = DEFAULT_SLOTS, timeout_s: float = 300.0,
) -> LayerStreamer:
    """The common end of a model family's streamed build: `model` (built on the meta
    device) gets real tensors outside its streamed `layers`, `load(skip)` loads them (skip:
    the streamed layers' `block.layers.{i}.` names), and a `LayerStreamer` over the mapped
    `files` (stored name -> file) streams the rest with `reads(i)`, on `context.device`
    with `context.counters`."""
    materialise_except(model, [layers[i] for i in streamed], context.device)
    load(lambda name: layer_index(name) in streamed)
    return LayerStreamer(layers, streamed, {i: reads(i) for i in streamed},
                         MappedCheckpoint(files), context.device, slots,
                         counters=context.counters, timeout_s=timeout_s)


def _set_tensor(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    mod, _, attr = name.rpartition(".")
    owner = layer.get_submodule(mod)
    if attr in owner._parameters:
        owner._parameters[attr] = (value if isinstance(value, nn.Parameter)
                                   else nn.Parameter(value, requires_grad=False))
    else:
        owner._buffers[attr] = value


@dataclass(frozen=True)
class _LayerPlan:
    """One streamed layer: its reads, each read's (shape, dtype) and slot offset, and the
    bytes its tensors hold (what one fill moves)."""

    index: int
    reads: tuple[TensorRead, ...]
    tensors: tuple[tuple[torch.Size, torch.dtype], ...]
    offsets: tuple[int, ...]
    used: int
    moved: int


# ---------------------------------------------------------------------- the streamer
class StreamCounters(Protocol):
    """What a `LayerStreamer` reports to (`headmoe.distributed.counters.Counters`)."""

    def record_stream(self, nbytes: int) -> None: ...


class LayerStreamer:
    """Streams the weights of `layers[i]`, i in `streamed`, through `slots` slot buffers.

    layers: the model's layer modules in execution order; a streamed layer's tensors are
    meta placeholders of the right shape and dtype (`materialise_except` built the rest).
    reads[i]: the `TensorRead`s of streamed layer i (one per parameter and buffer).
    source: the `MappedCheckpoint` they come from; device: where the layers run.
    counters: an object with `record_stream(nbytes)`, called with a layer's bytes each time
    a layer runs on a fresh fill (the runtime's "bytes moved" counter). timeout_s: how long
    a layer waits for its fill before `RuntimeError`.

    Attaches a forward pre-hook (wait for the fill, bind the slot's views) and a forward
    hook (unbind, start filling the slot with the layer `slots` positions later) to every
    streamed layer; `close()` removes them."""

    def __init__(self, layers: Sequence[nn.Module] | nn.ModuleList, streamed: Sequence[int],
                 reads: dict[int, list[TensorRead]], source: MappedCheckpoint,
                 device: torch.device, slots: int = DEFAULT_SLOTS, counters: StreamCounters | None = None,
                 timeout_s: float = 300.0):
        self.layers, self.source, self.device = list(layers), source, torch.device(device)
        self.slots, self.counters, self.timeout_s = check_slots(slots), counters, timeout_s
        self.cuda = self.device.type == "cuda"
        self.order = [self._plan(i, reads[i]) for i in streamed]
        self.slot_bytes = max((p.used for p in self.order), default=0)
        self.placeholders = {p.index: {r.name: local_tensor(self.layers[p.index], r.name)
                                       for r in p.reads} for p in self.order}
        self.position = {p.index: k for k, p in enumerate(self.order)}
        n = min(self.slots, len(self.order))
        pin = self.cuda
        self.host = [torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
                     for _ in range(n)]
        self.dev = ([torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                     for _ in range(n)] if self.cuda else self.host)
        if self.cuda:
            # torch.cuda's Stream and Event constructors carry no annotations
            self.copy_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.loaded_ev = [torch.cuda.Event() for _ in range(n)]  # type: ignore[no-untyped-call]
            self.free_ev = [torch.cuda.Event() for _ in range(n)]  # type: ignore[no-untyped-call]
        self.content: list[int | None] = [None] * n
        """Layer index whose weights slot s holds (or is being filled with)."""
        self.slot_of: dict[int, int] = {}
        """The slot of each layer in `content`."""
        self.fresh = [False] * n
        self.pending: list[Future[None] | None] = [None] * n
        self.bound: set[int] = set()
        self.fills = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headmoe-stream")
        self._hooks = []
        for p in self.order:
            layer = self.layers[p.index]
            self._hooks.append(layer.register_forward_pre_hook(self._pre_hook(p.index)))
            self._hooks.append(layer.register_forward_hook(self._post_hook(p.index),
                                                           always_call=True))

    def _plan(self, index: int, reads: list[TensorRead]) -> _LayerPlan:
        tensors = layer_tensors(self.layers[index], reads)
        offsets, used = slot_layout(tensors)
        moved = sum(torch.Size(s).numel() * d.itemsize for s, d in tensors)
        return _LayerPlan(index, tuple(reads), tuple(tensors), tuple(offsets), used, moved)

    # ------------------------------------------------------------------ worker side
    def _views(self, buf: torch.Tensor, plan: _LayerPlan) -> list[torch.Tensor]:
        return [buf[o : o + torch.Size(s).numel() * d.itemsize].view(d).view(s)
                for o, (s, d) in zip(plan.offsets, plan.tensors)]

    def _fill(self, plan: _LayerPlan, s: int) -> None:
        """(worker thread) read `plan`'s layer into host slot s; CUDA: copy it to device
        slot s on the copy stream once the compute stream released the slot."""
        if self.cuda:
            self.loaded_ev[s].synchronize()  # the last copy out of host slot s is done
        for read, dst in zip(plan.reads, self._views(self.host[s], plan)):
            self.source.read_into(read, dst)
        if self.cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.free_ev[s])
                self.dev[s][: plan.used].copy_(self.host[s][: plan.used], non_blocking=True)
                self.loaded_ev[s].record(self.copy_stream)

    def _submit(self, position: int, s: int) -> None:
        """Start filling slot s with the layer at `position` (mod the streamed layers)."""
        plan = self.order[position % len(self.order)]
        self.content[s], self.fresh[s] = plan.index, True
        self.slot_of[plan.index] = s
        self.pending[s] = self._pool.submit(self._fill, plan, s)
        self.fills += 1

    # ------------------------------------------------------------------ compute side
    def _resync(self, position: int) -> None:
        """Drop whatever the slots hold and fill them from `position` on (first forward, or
        after a forward that stopped midway)."""
        for f in self.pending:
            if f is not None:
                f.exception(timeout=self.timeout_s)  # finished, failed or not, before reuse
        for i in list(self.bound):
            self._unbind(i)
        self.slot_of.clear()
        for k in range(len(self.host)):
            self._submit(position + k, k)

    def _acquire(self, index: int) -> None:
        position = self.position[index]
        s = self.slot_of.get(index)
        if s is None or self.content[s] != index or self.pending[s] is None:
            self._resync(position)
            s = self.slot_of[index]
        try:
            cast("Future[None]", self.pending[s]).result(timeout=self.timeout_s)  # _resync filled s
        except FutureTimeout:
            raise RuntimeError(f"layer {index}'s weights were not read within "
                               f"{self.timeout_s:g} s (layer streaming)") from None
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.loaded_ev[s])
        plan = self.order[position]
        for read, view in zip(plan.reads, self._views(self.dev[s], plan)):
            _set_tensor(self.layers[index], read.name, view)
        self.bound.add(index)
        if self.fresh[s] and self.counters is not None:
            self.counters.record_stream(plan.moved)
        self.fresh[s] = False

    def _unbind(self, index: int) -> None:
        for name, placeholder in self.placeholders[index].items():
            _set_tensor(self.layers[index], name, placeholder)
        self.bound.discard(index)

    def _release(self, index: int) -> None:
        self._unbind(index)
        s = self.slot_of[index]
        if self.cuda:
            self.free_ev[s].record(torch.cuda.current_stream(self.device))
        if len(self.order) > len(self.host):  # else every streamed layer keeps its slot
            del self.slot_of[index]
            self._submit(self.position[index] + len(self.host), s)

    def _pre_hook(self, index: int) -> Callable[..., None]:
        return lambda module, args: self._acquire(index)

    def _post_hook(self, index: int) -> Callable[..., None]:
        return lambda module, args, output: self._release(index)

    def ready(self, layer: nn.Module) -> None:
        """Wait for the weights of ``layer`` (a streamed one; others: nothing) and bind them,
        as its pre-hook does (which then finds them bound): a read's error
        (`CheckpointChanged`, `OSError`) is raised here, before the layer's exchanges
        (`headmoe.pipeline.stop.LayerGate` calls it so that every rank stops together)."""
        index = self.index_of(layer)
        if index is not None:
            self._acquire(index)

    # ------------------------------------------------------------------ inspection
    @contextlib.contextmanager
    def use(self, index: int) -> Iterator[nn.Module]:
        """Layer `index` with its weights bound (as while it runs), released on exit."""
        self._acquire(index)
        try:
            yield self.layers[index]
        finally:
            self._release(index)

    def index_of(self, layer: nn.Module) -> int | None:
        """The index of streamed layer `layer` (None: not streamed by this streamer)."""
        return next((p.index for p in self.order if self.layers[p.index] is layer), None)

    def materialised(self) -> list[int]:
        """Layer indices whose weights the slots hold now (at most `slots`)."""
        return [i for i in self.content if i is not None]

    def close(self) -> None:
        """Wait for the worker, remove the hooks, unbind and unmap."""
        self._pool.shutdown(wait=True)
        for h in self._hooks:
            h.remove()
        for i in list(self.bound):
            self._unbind(i)
        self.content = [None] * len(self.host)
        self.source.close()
