"""Refiner checkpoints under the released tensor names (REFINER.md section 3): spec,
header checks, loading, random writer (safetensors only).

The release's loader builds the module and calls `load_state_dict(strict=True)` with no
renaming, so a checkpoint holds exactly the module's names: 281 tensors and 6,720,075,280
values for `magi2-refiner` (golden/magi2_refiner/refiner_tensors.tsv), the layer linears
in `params_dtype`, everything else fp32. The header checks, the optional `transformer.`
prefix, the index containment and the float casts are those of
`headmoe.models.magi2.loading` (`check_headers`); every rank reads every tensor (the
refiner is not sharded by weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from headmoe.distributed.context import ParallelContext
from headmoe.models.magi2.loading import (
    LOAD_BATCH_BYTES,
    LoadReport,
    check_headers,
    load_in_batches,
    read_headers,
    write_random_tensors,
)
from headmoe.models.refiner.config import Magi2RefinerConfig
from headmoe.models.refiner.model import Magi2Refiner
from headmoe.models.streaming import (
    DEFAULT_SLOTS,
    LayerStreamer,
    attach_streamer,
    check_slots,
    split_layers,
    whole_reads,
)


def refiner_spec(config: Magi2RefinerConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a full refiner checkpoint: name -> (shape, dtype), in the module's
    `state_dict` order (built on the meta device)."""
    with torch.device("meta"):
        model = Magi2Refiner(config, dtype=config.torch_params_dtype)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def refiner_parameter_count(config: Magi2RefinerConfig) -> int:
    """Values in a full checkpoint (6,720,075,280 for `magi2-refiner`)."""
    return sum(torch.Size(s).numel() for s, _ in refiner_spec(config).values())


def refiner_weight_bytes(config: Magi2RefinerConfig, dtype: torch.dtype | None = None) -> int:
    """Bytes of the refiner's weights held in a model of `dtype` (None: the release's):
    layer linears in that dtype, the rest fp32 (12.56 GiB for `magi2-refiner` in bf16)."""
    total = 0
    for shape, d in refiner_spec(config).values():
        size = (dtype or d).itemsize if d != torch.float32 else 4
        total += torch.Size(shape).numel() * size
    return total


def check_refiner_checkpoint(
    config: Magi2RefinerConfig, path: str | os.PathLike[str], param_dtype: torch.dtype | None = None
) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], LoadReport]:
    """Check a refiner checkpoint's headers against `config` without reading a tensor;
    raises `ValueError` naming every missing, unexpected, mis-shaped or non-float tensor.
    The layer count is checked first (`read_headers`, the preview's check), before the
    spec's skeleton of ``num_layers`` layers is built."""
    what = f"refiner config {config.name!r}"
    found = read_headers(path, config.num_layers, what)
    return check_headers(refiner_spec(config), path, param_dtype, what, found)


def load_refiner(
    model: Magi2Refiner, path: str | os.PathLike[str], *, max_batch_bytes: int = LOAD_BATCH_BYTES,
    skip: Callable[[str], bool] | None = None,
) -> LoadReport:
    """Load `path` (a `.safetensors` file or a `*.safetensors.index.json`) into `model`:
    every header checked first (`check_refiner_checkpoint`), then every tensor read, cast
    to its parameter's dtype and copied in batches of about `max_batch_bytes`. Names for
    which `skip(name)` is true are neither read nor loaded (the streamed layers)."""
    headers, report = check_refiner_checkpoint(model.config, path, model.dtype)
    load_in_batches(model, headers, lambda f, name: f.get_tensor(report.prefix + name),
                    max_batch_bytes, skip)
    return report


def stream_refiner(
    config: Magi2RefinerConfig, context: ParallelContext, dtype: torch.dtype,
    path: str | os.PathLike[str], *, resident_layers: int = 0, slots: int = DEFAULT_SLOTS,
    timeout_s: float = 300.0,
) -> tuple[Magi2Refiner, LayerStreamer]:
    """A `Magi2Refiner` on `context.device` whose layers after the first `resident_layers`
    stream from `path` through `slots` slot buffers (`headmoe.models.streaming`; every
    rank reads every tensor of a layer); the rest is loaded once (`load_refiner`)."""
    _, streamed = split_layers(config.num_layers, resident_layers)
    check_slots(slots)
    headers, report = check_refiner_checkpoint(config, path, dtype)
    with torch.device("meta"):
        model = Magi2Refiner(config, context, dtype=dtype)
    layers = model.block.layers
    files = {report.prefix + n: f for n, (f, _, _) in headers.items()}
    return model, attach_streamer(
        model, layers, streamed, lambda skip: load_refiner(model, path, skip=skip),
        lambda i: whole_reads(layers[i], f"{report.prefix}block.layers.{i}."), files, context,
        slots, timeout_s)


def write_random_refiner(
    config: Magi2RefinerConfig, path: str | os.PathLike[str], seed: int = 0, *,
    max_shard_bytes: int = 1 << 30,
) -> None:
    """Deterministic random refiner weights under the released names and dtypes
    (`write_random_tensors`: one file, or shards plus an index for a
    `*.safetensors.index.json` path)."""
    write_random_tensors(refiner_spec(config), path, seed, max_shard_bytes=max_shard_bytes)
