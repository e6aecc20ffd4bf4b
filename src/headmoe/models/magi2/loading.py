"""Checkpoints by MAGI-2's tensor names: random writer and per-rank loader (safetensors).

A checkpoint holds the full, unsharded tensors under the names of `Magi2Transformer`'s
state dict (MAGI-2's names, see docs/model.md): linears and experts in bf16, everything
else in fp32, as MAGI-2 releases them. Loading reads, on each rank, only what the rank
holds: for MoE expert tensors (`...mlp.moe_mlp.*`) the rows of its EP shard's heads
(`moe_row_slice`), read with `safe_open(...).get_slice(name)[start:stop]`; padded heads
stay zero.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headmoe.models.magi2.config import Magi2Config
from headmoe.models.magi2.model import Magi2Transformer
from headmoe.moe import moe_row_slice

INDEX_SUFFIX = ".safetensors.index.json"
MOE_MARKER = ".mlp.moe_mlp."


def checkpoint_spec(config: Magi2Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a full checkpoint: name -> (shape, dtype), in the model's order.

    Built from a one-rank bf16 model on the meta device (no allocation)."""
    with torch.device("meta"):
        model = Magi2Transformer(config, dtype=torch.bfloat16)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "norm" in name:  # RMSNorm deltas
        x = 0.1 * x
    elif "mhc_alpha" in name:
        x = 0.5 + 0.1 * x
    elif "mhc_bias" in name or leaf == "bias" or "expert_bias" in name:
        x = 0.1 * x
    elif "mhc_phi" in name:
        pass  # x Phi with x RMS-normalised: unit-scale logits before the 1/sqrt(nC) scale
    elif leaf == "sinks":
        pass
    elif leaf in ("W_gate", "W_up", "W_down"):
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
    config: Magi2Config, path: str | os.PathLike, seed: int = 0, *,
    max_shard_bytes: int = 1 << 30,
) -> None:
    """Write deterministic random weights for `config` (same `seed`, same values).

    `path` ending in `.safetensors.index.json` writes shards of at most `max_shard_bytes`
    (a larger tensor gets a shard of its own) named `<stem>-00001-of-0000N.safetensors`
    next to an index `{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`, one
    shard in memory at a time; any other path writes one safetensors file."""
    path = os.fspath(path)
    spec = checkpoint_spec(config)
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


def _weight_map(path: str) -> dict[str, str]:
    """name -> file for a safetensors file or a sharded index."""
    if path.endswith(INDEX_SUFFIX):
        with open(path) as f:
            index = json.load(f)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"checkpoint index {path!r} has no 'weight_map' object")
        base = os.path.dirname(path)
        return {k: os.path.join(base, v) for k, v in index["weight_map"].items()}
    with safe_open(path, framework="pt") as f:
        return dict.fromkeys(f.keys(), path)


def load_checkpoint(
    model: Magi2Transformer, path: str | os.PathLike, *, max_batch_bytes: int = 1 << 30
) -> None:
    """Load `path` (a `.safetensors` file or a `*.safetensors.index.json`) into `model`.

    Each rank reads only its MoE rows: rows `[start, stop)` from `moe_row_slice(heads,
    experts, EP, ep_rank)` fill the first local rows, padded heads stay zero. Tensors are
    cast to the parameter's dtype. Raises `ValueError` naming every missing, unexpected or
    mis-shaped tensor before anything is loaded (names and shapes come from the file
    headers). Tensors are then read and copied into the model in batches of about
    `max_batch_bytes`, so the host holds one batch, not a rank's whole state; the router
    biases go last, in one batch, so that `bias_from_ema` sees both of each layer."""
    path = os.fspath(path)
    cfg, ctx = model.config, model.context
    spec = checkpoint_spec(cfg)
    where = _weight_map(path)
    missing = [n for n in spec if n not in where]
    unexpected = sorted(n for n in where if n not in spec)
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if problems:
        raise ValueError(f"checkpoint {path!r}: " + "; ".join(problems))
    by_file: dict[str, list[str]] = {}
    for name in spec:
        by_file.setdefault(where[name], []).append(name)
    bad = []
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != spec[name][0]:
                    bad.append(f"{name} has shape {list(shape)}, expected {list(spec[name][0])}")
    if bad:
        raise ValueError(f"checkpoint {path!r}: mis-shaped tensors: " + "; ".join(bad))
    start, stop, _ = moe_row_slice(
        cfg.moe_num_heads, cfg.moe_num_experts, ctx.topology.expert_parallel_size, ctx.coords.ep
    )
    local = model.state_dict()
    batch: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}

    def flush(tensors: dict[str, torch.Tensor]) -> None:
        result = model.load_state_dict(tensors, strict=False)
        assert not result.unexpected_keys, result.unexpected_keys  # names checked above
        tensors.clear()

    held = 0
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                target = local[name]
                if MOE_MARKER in name:
                    tensor = torch.zeros(target.shape, dtype=target.dtype)
                    tensor[: stop - start] = f.get_slice(name)[start:stop].to(target.dtype)
                else:
                    tensor = f.get_tensor(name).to(target.dtype)
                if "router.expert_bias" in name:
                    biases[name] = tensor
                    continue
                batch[name] = tensor
                held += tensor.numel() * tensor.element_size()
                if held >= max_batch_bytes:
                    flush(batch)
                    held = 0
    flush(batch)
    flush(biases)
