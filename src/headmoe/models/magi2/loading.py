"""MAGI-2 checkpoints under the released tensor names: checks, per-rank streaming loader,
random writer (safetensors only).

A checkpoint holds the full, unsharded tensors of the released transformer (MAGI2.md
section 4; golden/magi2/preview_tensors.tsv for MAGI-2 Preview): linears and
experts in `params_dtype`, everything else in fp32. Names may all carry a `transformer.`
prefix (a mix of prefixed and bare names is refused). Loading first checks every header
(names, shapes, dtypes; index files and their shard paths) and refuses the checkpoint
before any tensor is read, naming each problem. Float tensors in another float dtype than
the model's parameter are cast to the parameter's dtype (as the release's own loader does
when it loads into a model of another dtype) and reported in the returned `LoadReport`;
integer and bool tensors are refused. Each rank then reads only what it holds: for the
MoE expert tensors (`...mlp.moe_mlp.*`) the rows of its EP shard's heads
(`read_moe_rows`), streamed into the model in batches of bounded host memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from headmoe.distributed.context import ParallelContext
from headmoe.files import index_map, listing
from headmoe.layers.rope import default_bands
from headmoe.models.magi2.config import Magi2Config
from headmoe.models.magi2.model import Magi2Transformer
from headmoe.models.streaming import (
    DEFAULT_SLOTS,
    FLOAT_DTYPES,
    LayerStreamer,
    TensorRead,
    attach_streamer,
    check_slots,
    split_layers,
)
from headmoe.moe import MultiHeadMoE, read_moe_rows
from headmoe.moe.formats import (
    DEFAULT_EXPERT_FORMAT,
    EXPERT_FORMATS,
    STORED_NAMES,
    format_name,
    stored_format,
)
from headmoe.moe.fp8 import FP8_DTYPE, check_fp8_bytes, quantize
from headmoe.moe.fp8_format import SCALE_SUFFIX, VALUES
from headmoe.moe.weights import Bf16Experts, ExpertWeights

INDEX_SUFFIX = ".safetensors.index.json"
#: the most checkpoint bytes a loader reads into host memory at once before copying them to
#: the model (both families' `load_*`; the planner counts it as load memory)
LOAD_BATCH_BYTES = 1 << 30
MOE_MARKER = ".mlp.moe_mlp."
PREFIX = "transformer."
#: name prefix of transformer layer ``i``'s tensors: ``block.layers.<i>.``
LAYER_PREFIX = "block.layers."
_LAYER = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.")
_DTYPE_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}


def checkpoint_spec(config: Magi2Config, experts: type[ExpertWeights] = Bf16Experts
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a full released checkpoint: name -> (shape, dtype), in the model's
    order (linears and experts in `config.params_dtype`, the rest fp32; the routed experts'
    tensors those of the format `experts`, e.g. FP8 values and fp32 scales). Built from a
    one-rank model on the meta device (no allocation)."""
    with torch.device("meta"):
        model = Magi2Transformer(config, dtype=config.torch_params_dtype, experts=experts)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def spec_digest(config: Magi2Config, *extra: object) -> str:
    """16 hex digits of sha256 over `config`, its `checkpoint_spec` (names, shapes, dtypes)
    and ``extra`` (JSON-able): the one cache key of the tiny model's files."""
    spec = {k: [list(s), str(d)] for k, (s, d) in checkpoint_spec(config).items()}
    key = json.dumps([config.to_dict(), spec, *extra], default=list, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def parameter_count(config: Magi2Config) -> int:
    """Values in a full checkpoint of `config` (113,934,953,536 for `magi2-preview`)."""
    return sum(torch.Size(s).numel() for s, _ in checkpoint_spec(config).values())


@dataclass
class LoadReport:
    """What `load_checkpoint` did besides loading: `converted` lists `(name, stored dtype,
    parameter dtype)` of float tensors cast on load; `prefix` is the name prefix found."""

    prefix: str = ""
    converted: list[tuple[str, str, str]] = field(default_factory=list)
    expert_format: str = DEFAULT_EXPERT_FORMAT
    """The routed experts' format the headers show (`headmoe.moe.formats.stored_format`)."""


# ---------------------------------------------------------------------- headers
#: checked headers: stored or model name -> (file, shape, safetensors dtype)
Headers = dict[str, tuple[str, tuple[int, ...], str]]


class TensorSource(Protocol):
    """An open safetensors file (`safe_open`'s handle): reads one stored tensor."""

    def get_tensor(self, name: str) -> torch.Tensor: ...


def _headers(path: str) -> Headers:
    """stored name -> (file, shape, safetensors dtype) from the file headers only."""
    where = index_map(path) if path.endswith(INDEX_SUFFIX) else None
    files = sorted(set(where.values())) if where is not None else [path]
    out: dict[str, tuple[str, tuple[int, ...], str]] = {}
    twice: list[str] = []
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names = f.keys()  # safe_open handles are not iterable
                for name in names:
                    if name in out:
                        twice.append(f"{name} (in {os.path.basename(out[name][0])} and "
                                     f"{os.path.basename(file)})")
                    part = f.get_slice(name)
                    out[name] = (file, tuple(part.get_shape()), part.get_dtype())
        except (OSError, SafetensorError) as e:
            raise ValueError(f"checkpoint file {file!r} is not a readable safetensors file: "
                             f"{e}") from None
    if twice:
        raise ValueError(f"checkpoint {path!r}: " + listing(
            "tensors stored in two shards (keep each tensor in one)", twice))
    if where is not None:
        missing = sorted(n for n, f in where.items() if out.get(n, (f,))[0] != f)
        if missing:
            raise ValueError(f"checkpoint index {path!r}: " + listing(
                "tensors not found in their shard", missing))
    return out


def check_layer_count(num_layers: int, path: str, headers: Headers, what: str,
                      detail: Callable[[Headers], str] | None = None) -> None:
    """Refuse a config (``what``, e.g. ``"refiner config 'x'"``) whose ``num_layers``
    differs from the ``block.layers.<i>.`` layers the headers hold, so a 1,000,000-layer
    config is refused at once, not after building its skeleton: the one check of both the
    preview's and the refiner's loaders (``detail(headers)`` adds to the message)."""
    found = {int(m.group(1)) for n in headers if (m := _LAYER.match(n))}
    count = max(found) + 1 if found else 0
    if num_layers != count:
        raise ValueError(f"checkpoint {path!r} holds {count} transformer layers "
                         f"({LAYER_PREFIX}0..{count - 1}) but {what} has "
                         f"num_layers={num_layers}{detail(headers) if detail else ''}; "
                         "use the config of this checkpoint")


def read_headers(path: str | os.PathLike[str], num_layers: int, what: str,
                 detail: Callable[[Headers], str] | None = None) -> tuple[str, Headers]:
    """(prefix, headers) of a checkpoint (the ``transformer.`` prefix stripped), after
    `check_layer_count` against ``num_layers``; for `check_headers`."""
    path = os.fspath(path)
    found = _strip_prefix(path, _headers(path))
    check_layer_count(num_layers, path, found[1], what, detail)
    return found


#: the largest config whose tensors a layer-count refusal also compares (a meta skeleton)
DETAIL_MAX_LAYERS = 256


def _first_mismatches(config: Magi2Config, headers: Headers) -> str:
    """``"; N mis-shaped tensors: ..."`` for the tensors both the headers and `config` name,
    so a refusal shows which tensors differ; empty for a config too large to build."""
    if config.num_layers > DETAIL_MAX_LAYERS:
        return ""
    spec = checkpoint_spec(config, EXPERT_FORMATS[stored_format(headers)])
    bad = [f"{name} expected {list(shape)}, found {list(headers[name][1])}"
           for name, (shape, _) in spec.items()
           if name in headers and tuple(headers[name][1]) != shape]
    return "; " + listing("mis-shaped tensors", bad) if bad else ""


def _strip_prefix(path: str, headers: Headers) -> tuple[str, Headers]:
    prefixed = [n for n in headers if n.startswith(PREFIX)]
    if not prefixed:
        return "", headers
    if len(prefixed) != len(headers):
        bare = sorted(n for n in headers if not n.startswith(PREFIX))
        raise ValueError(f"checkpoint {path!r} mixes names with and without the "
                         f"{PREFIX!r} prefix; " + listing("bare names", bare))
    return PREFIX, {n[len(PREFIX):]: v for n, v in headers.items()}


def check_checkpoint(
    config: Magi2Config, path: str | os.PathLike[str], param_dtype: torch.dtype | None = None
) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], LoadReport]:
    """Check a checkpoint's headers against `config` without reading any tensor
    (`param_dtype`: the model dtype the tensors will be cast to; None: the config's).

    The routed experts' format is the one the names show (`stored_format`: FP8 values
    and their ``_scale`` tensors, or the release's), recorded in the report's
    ``expert_format``; the headers are checked against that format's spec.

    Returns (model name -> (file, shape, stored dtype), report). Raises `ValueError` naming
    every missing, unexpected, mis-shaped and non-float tensor (expected shape and dtype,
    found), or the unreadable file."""
    what = f"model config {config.name!r}"
    # before a skeleton of num_layers is built
    found = read_headers(path, config.num_layers, what,
                         lambda headers: _first_mismatches(config, headers))
    stored = stored_format(found[1])
    headers, report = check_headers(checkpoint_spec(config, EXPERT_FORMATS[stored]), path,
                                    param_dtype, what if stored == "bf16" else f"{what} (FP8 experts)",
                                    found)
    report.expert_format = stored
    return headers, report


def stored_expert_format(path: str | os.PathLike[str]) -> str:
    """The routed experts' format of the checkpoint at `path` from its tensor names
    (`stored_format`; headers only, unchecked: `check_checkpoint` checks them)."""
    return stored_format(_strip_prefix(os.fspath(path), _headers(os.fspath(path)))[1])


def check_headers(
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]], path: str | os.PathLike[str],
    param_dtype: torch.dtype | None, what: str, found: tuple[str, Headers] | None = None,
) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], LoadReport]:
    """`check_checkpoint` against any tensor `spec` (name -> (shape, dtype)); `what` names
    the model in the error ("model config 'tiny'"); `found`: the (prefix, headers) already
    read."""
    path = os.fspath(path)
    prefix, headers = found or _strip_prefix(path, _headers(path))
    report = LoadReport(prefix=prefix)
    problems = []
    missing = [n for n in spec if n not in headers]
    if missing:
        problems.append(listing("missing tensors", missing))
    unexpected = sorted(prefix + n for n in headers if n not in spec)
    if unexpected:
        problems.append(listing("unexpected tensors", unexpected))
    bad_shape, bad_dtype, bad_fp8 = [], [], []
    for name, (shape, dtype) in spec.items():
        if name not in headers:
            continue
        _, got, stored = headers[name]
        want = f"{list(shape)} {_DTYPE_NAMES[dtype]}"
        if got != shape:
            bad_shape.append(f"{prefix + name} expected {want}, found {list(got)} {stored}")
        elif stored not in FLOAT_DTYPES:
            bad_dtype.append(f"{prefix + name} expected {want}, found {stored}")
        elif FP8_DTYPE in (dtype, FLOAT_DTYPES[stored]) and FLOAT_DTYPES[stored] != dtype:
            bad_fp8.append(f"{prefix + name} expected {want}, found {stored}")
        else:
            target = dtype if dtype in (torch.float32, FP8_DTYPE) or param_dtype is None \
                else param_dtype
            if FLOAT_DTYPES[stored] != target:
                report.converted.append((prefix + name, stored, _DTYPE_NAMES[target]))
    if bad_shape:
        problems.append(listing("mis-shaped tensors", bad_shape))
    if bad_dtype:
        problems.append(listing("tensors of a non-float dtype", bad_dtype))
    if bad_fp8:
        problems.append(listing("tensors to or from FP8, which are never cast", bad_fp8))
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match {what}: " + "; ".join(problems))
    return headers, report


# ---------------------------------------------------------------------- loading
def load_checkpoint(
    model: Magi2Transformer, path: str | os.PathLike[str], *, max_batch_bytes: int = LOAD_BATCH_BYTES,
    skip: Callable[[str], bool] | None = None,
) -> LoadReport:
    """Load `path` (a `.safetensors` file or a `*.safetensors.index.json`) into `model`.

    Checks every header first (`check_checkpoint`); then each rank reads only its MoE rows
    (`read_moe_rows`: its EP shard's heads, padded heads stay zero) and the full other
    tensors, cast to the parameter's dtype, copied into the model in batches of about
    `max_batch_bytes` (the host holds one batch, not a rank's state). The router biases go
    last, in one batch, so that `bias_from_ema` sees both of each layer. Names for which
    `skip(name)` is true are neither read nor loaded (the streamed layers)."""
    path = os.fspath(path)
    cfg = model.config
    headers, report = check_checkpoint(cfg, path, model.dtype)
    moes = [m for m in model.modules() if isinstance(m, MultiHeadMoE)]
    shards = {m.shard for m in moes}
    assert len(shards) <= 1, shards  # every MoE layer of a rank holds the same heads
    shard = shards.pop() if shards else None
    fmt = format_name(moes[0].experts) if moes else report.expert_format
    check_model_format(fmt, report.expert_format, path)
    if fmt != report.expert_format:  # the model's scales come from the stored values
        headers = {**headers, **{n: headers[n.removesuffix(SCALE_SUFFIX)]
                                 for n in model.state_dict() if _scale_of_value(n)}}

    def rows(f: TensorSource, name: str) -> torch.Tensor:
        assert shard is not None  # an MoE tensor's layer is an MoE layer of this rank
        return read_moe_rows(f, report.prefix + name, cfg.moe_num_heads,
                             cfg.moe_num_experts, shard.ep_size, shard.ep_rank)

    quantized = QuantizeOnLoad(rows, report.prefix)

    def read(f: TensorSource, name: str) -> torch.Tensor:
        if MOE_MARKER not in name:
            return f.get_tensor(report.prefix + name)
        if fmt != report.expert_format and _expert_leaf(name):
            return quantized.read(f, name)
        t = rows(f, name)
        if t.dtype == FP8_DTYPE:
            check_fp8_bytes(report.prefix + name, t)
        return t

    load_in_batches(model, headers, read, max_batch_bytes, skip,
                    last=lambda name: "router.expert_bias" in name)
    return report


def _expert_leaf(name: str) -> bool:
    """`name` is a routed expert's FP8 value or scale tensor (`Fp8Experts.NAMES`)."""
    return name.rsplit(".", 1)[-1].removesuffix(SCALE_SUFFIX) in VALUES


def _scale_of_value(name: str) -> bool:
    return MOE_MARKER in name and name.endswith(SCALE_SUFFIX) and _expert_leaf(name)


def check_model_format(model_format: str, stored: str, path: str) -> None:
    """A model in `model_format` loads a checkpoint whose experts are `stored`: the same
    format, or FP8 from bf16 (quantized on load); `ValueError` naming both otherwise."""
    if model_format != stored and not (model_format == "fp8" and stored == "bf16"):
        raise ValueError(f"checkpoint {path!r} stores its routed experts as "
                         f"{STORED_NAMES[stored]}, which a model of expert_format="
                         f"{model_format!r} cannot load (use expert_format={stored!r})")


class QuantizeOnLoad:
    """FP8 values and scales of this rank's rows of the bf16 experts (`headmoe.moe.fp8.
    quantize`, per (head, expert) and output channel), one stored tensor at a time: reading
    ``...W_gate`` quantizes the stored ``W_gate`` rows and keeps the scale until
    ``...W_gate_scale`` is read (and the other way round), so the host holds one layer's
    tensor and its scale, not a layer's worth of copies. `rows(f, name)`: the stored rows
    of this rank (`read_moe_rows`); `prefix` the stored names' prefix (errors name them)."""

    def __init__(self, rows: Callable[[TensorSource, str], torch.Tensor], prefix: str):
        self.rows, self.prefix = rows, prefix
        self.kept: dict[str, torch.Tensor] = {}

    def read(self, f: TensorSource, name: str) -> torch.Tensor:
        """The FP8 values `[rows, K, N]` float8_e4m3fn or scales `[rows, N]` fp32 of
        model tensor `name` (a value name or its ``_scale``)."""
        if name in self.kept:
            return self.kept.pop(name)
        value = name.removesuffix(SCALE_SUFFIX)
        w = quantize(self.prefix + value, self.rows(f, value))
        if name == value:
            self.kept[value + SCALE_SUFFIX] = w.scale
            return w.data
        self.kept[value] = w.data
        return w.scale


def load_in_batches(
    model: torch.nn.Module, headers: dict[str, tuple[str, tuple[int, ...], str]],
    read: Callable[[TensorSource, str], torch.Tensor], max_batch_bytes: int,
    skip: Callable[[str], bool] | None = None, last: Callable[[str], bool] | None = None,
) -> None:
    """Copy every tensor of `model` (but those `skip` names) from its file in `headers`
    (checked names -> (file, shape, dtype)): ``read(safe_open handle, name)`` reads it, it
    is cast to the parameter's dtype and copied in batches of about `max_batch_bytes`; the
    names `last` picks are copied after all others, in one batch."""
    local = model.state_dict()
    by_file: dict[str, list[str]] = {}
    for name in local:
        if skip is None or not skip(name):
            by_file.setdefault(headers[name][0], []).append(name)
    batch: dict[str, torch.Tensor] = {}
    deferred: dict[str, torch.Tensor] = {}
    held = 0
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensor = read(f, name).to(local[name].dtype)
                if last is not None and last(name):
                    deferred[name] = tensor
                    continue
                batch[name] = tensor
                held += tensor.numel() * tensor.element_size()
                if held >= max_batch_bytes:
                    flush_batch(model, batch)
                    held = 0
    flush_batch(model, batch)
    flush_batch(model, deferred)


# ---------------------------------------------------------------------- streamed layers
def layer_reads(model: Magi2Transformer, layer_id: int, prefix: str = "") -> list[TensorRead]:
    """The `TensorRead`s of `block.layers.{layer_id}` on this rank: every parameter and
    buffer; the MoE row tensors read the rows of this rank's head shard only, and each local
    tensor reads the stored tensor whose values it takes (`MultiHeadMoE.source_name`)."""
    layer = model.block.layers[layer_id]
    base = f"{prefix}block.layers.{layer_id}."
    moe = next((m for m in layer.modules() if isinstance(m, MultiHeadMoE)), None)
    at = next((n for n, m in layer.named_modules() if m is moe), None)
    reads = []
    for name, _ in [*layer.named_parameters(), *layer.named_buffers()]:
        key, rows = name, None
        if moe is not None and at is not None and name.startswith(at + "."):
            local = name[len(at) + 1 :]
            key = f"{at}.{moe.source_name(local)}"
            if local in moe.row_tensors:
                rows = (moe.row_start, moe.row_stop)
        reads.append(TensorRead(name, base + key, rows))
    return reads


def stream_layers(
    config: Magi2Config, context: ParallelContext, dtype: torch.dtype, path: str | os.PathLike[str], *,
    resident_layers: int = 0, slots: int = DEFAULT_SLOTS, timeout_s: float = 300.0,
    experts: type[ExpertWeights] = Bf16Experts,
) -> tuple[Magi2Transformer, LayerStreamer]:
    """A `Magi2Transformer` on `context.device` whose layers after the first
    `resident_layers` stream from `path` through `slots` slot buffers (`headmoe.models.
    streaming`); everything else is loaded once (`load_checkpoint`). Checks every header
    first; refuses a bad `resident_layers` / `slots` before anything is allocated, and an
    expert format `experts` other than the stored one (the slots take stored bytes)."""
    path = os.fspath(path)
    _, streamed = split_layers(config.num_layers, resident_layers)
    check_slots(slots)
    headers, report = check_checkpoint(config, path, dtype)
    if format_name(experts()) != report.expert_format:  # the streamer copies stored bytes
        raise ValueError(f"offload_layers streams the stored bytes of {path!r}, whose "
                         f"experts are {report.expert_format}: expert_format="
                         f"{format_name(experts())!r} needs a checkpoint stored in that format "
                         "('headmoe quantize' writes an FP8 release folder)")
    with torch.device("meta"):
        model = Magi2Transformer(config, context, dtype=dtype, experts=experts)
    files = {report.prefix + n: f for n, (f, _, _) in headers.items()}
    return model, attach_streamer(
        model, model.block.layers, streamed, lambda skip: load_checkpoint(model, path, skip=skip),
        lambda i: layer_reads(model, i, report.prefix), files, context, slots, timeout_s)


def flush_batch(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a batch of checked tensors (name -> tensor) into `model` and empty the batch."""
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys  # names checked above
    tensors.clear()


# ---------------------------------------------------------------------- random weights
def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if leaf == "bands":
        return default_bands(shape[0])
    if "norm" in name:  # RMSNorm deltas
        x = 0.1 * x
    elif "mhc_alpha" in name:
        x = 0.5 + 0.1 * x
    elif "mhc_bias" in name or leaf == "bias" or "expert_bias" in name:
        x = 0.1 * x
    elif "mhc_phi" in name or leaf == "sinks":
        pass  # x Phi with x RMS-normalised: unit-scale logits before the 1/sqrt(V) scale
    elif leaf in Bf16Experts.NAMES:
        x = x / shape[1] ** 0.5  # [rows, in, out]
    else:  # linears [out, in] and the router gate [rows, d_head]
        x = x / shape[-1] ** 0.5
    return x.to(dtype)


def _random_tensors(
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]], names: list[str], seed: int
) -> dict[str, torch.Tensor]:
    """The named tensors; tensor i of `spec` is drawn from its own generator seeded by
    (seed, i), so any subset (a shard) is generated alone with the same values."""
    index = {name: i for i, name in enumerate(spec)}
    gen = torch.Generator()
    out = {}
    for name in names:
        gen.manual_seed(seed * 1_000_003 + index[name])
        out[name] = _random_tensor(name, *spec[name], gen)
    return out


def write_random_checkpoint(
    config: Magi2Config, path: str | os.PathLike[str], seed: int = 0, *,
    max_shard_bytes: int = 1 << 30,
) -> None:
    """Write deterministic random weights for `config` under the released names and dtypes
    (same `seed`, same values); see `write_random_tensors`."""
    write_random_tensors(checkpoint_spec(config), path, seed, max_shard_bytes=max_shard_bytes)


def write_random_tensors(
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]], path: str | os.PathLike[str],
    seed: int = 0, *, max_shard_bytes: int = 1 << 30,
) -> None:
    """Write deterministic random tensors of `spec` (name -> (shape, dtype)).

    `path` ending in `.safetensors.index.json` writes shards of at most `max_shard_bytes`
    (a larger tensor gets a shard of its own) named `<stem>-00001-of-0000N.safetensors`
    next to an index `{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`, one
    shard in memory at a time; any other path writes one safetensors file."""
    path = os.fspath(path)
    if not path.endswith(INDEX_SUFFIX):
        save_file(_random_tensors(spec, list(spec), seed), path)
        return
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in spec.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    stem = os.path.basename(path)[: -len(INDEX_SUFFIX)]
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(_random_tensors(spec, names, seed), os.path.join(os.path.dirname(path), file))
        weight_map.update(dict.fromkeys(names, file))
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in spec.values())
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
