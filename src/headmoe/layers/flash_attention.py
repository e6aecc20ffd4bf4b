"""Sink attention through a flash backend that returns the log-sum-exp (issue 30 point 3).

The sink from the LSE. For one query row with scaled scores `s_t` over the segment's keys,
values `v_t` and the head's sink logit `sigma` (one more key with logit `sigma` and a zero
value, `headmoe.layers.attention.sink_attention`'s definition):

    out_sink = sum_t exp(s_t) v_t / (sum_t exp(s_t) + exp(sigma))
             = [sum_t exp(s_t) v_t / Z] * Z / (Z + exp(sigma))        with Z = sum_t exp(s_t)
             = out * 1 / (1 + exp(sigma - lse))                       with lse = log Z
             = out * sigmoid(lse - sigma)

where `out` is plain softmax attention without the sink, so a backend that returns `out` and
`lse` (natural log, fp32, per query row and head) gives the sink result exactly up to
rounding (`apply_sink`; tests/layers/test_flash_attention.py checks
it against the definition in fp64/fp32 on random shapes). A segment has at least one key, so
`lse` is finite (no fully masked row: segments attend within themselves, without a mask).

Backends (`FlashBackend`: q, k, v `[L, h, D]` packed, the segments' boundaries -> out
`[L, h, D]` in q's dtype and the natural-log LSE per head and row):
- "flash": `torch.ops.aten._flash_attention_forward` (torch's FlashAttention-2, varlen: one
  call for every segment via cumulative sequence lengths) with `num_splits=1`: split-KV is
  pinned to one split, so the grid is one CTA per (query block, head, segment) and no
  heuristic that reads the head count (FA2's split-KV chooser weighs batch x heads x blocks
  against the SM count) can change a head's reduction order. bf16/fp16 only, D <= 256 and
  a multiple of 8.
- "cudnn": `torch.ops.aten._scaled_dot_product_cudnn_attention` per segment with
  `compute_log_sumexp=True`. cuDNN exposes no split control; its invariance over head
  subsets is only what `benchmarks/gpu_check.py` section d measures on a device.
Neither backend documents bit invariance; `ATTENTION_CHOICES`' "auto" takes the flash path
only once `gpu_check` has recorded its probe passing on this device and stack
(`proof_key`, `read_proof`).

What is not covered: the refiner's block-sparse range attention (no sink, key ranges that
are not contiguous segments) stays on its Triton kernel; fp32 models and head dims the
backend does not take run the Triton kernel (`flash_supported`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from headmoe.files import atomic_write

#: `--attention`: auto (flash once proven on this device and stack, else triton), triton,
#: flash (refused where no CUDA device runs the ranks)
ATTENTION_CHOICES = ("auto", "triton", "flash")
#: the paths `resolve_attention` answers (`Deployment.attention`, the forward plan's)
ATTENTION_PATHS = ("triton", "flash")
#: the flash backends `flash_segment_attention` names
FLASH_BACKENDS = ("flash", "cudnn")
#: the file under the cache dir where `gpu_check` records the invariance proofs
PROOF_FILE = "attention_proof.json"

#: q, k, v `[L, h, D]`, the segments' cumulative boundaries `[0, ..., L]` (host ints),
#: scale -> (out `[L, h, D]` in q's dtype, lse: `[h, L]`, or `[S, h, max_len]` padded per
#: segment with an optional trailing 1; `_lse_rows` reads both)
FlashBackend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float],
                        tuple[torch.Tensor, torch.Tensor]]


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sink applied to attention computed without it, from its log-sum-exp:
    `out * sigmoid(lse - sigma_h)` (= `exp(lse) / (exp(lse) + exp(sigma_h))`, the weight the
    softmax leaves to the real keys once the sink key joins them).

    out: `[L, h, D]` (any float dtype); lse: `[L, h]` fp32 natural-log sum-exp of the scaled
    scores of each query row (what flash kernels return); sinks `[h]` fp32. Returns fp32
    `[L, h, D]`. The derivation: this module's docstring; tested on CPU against
    `headmoe.layers.attention.sink_attention` (tests/layers/test_flash_attention.py)."""
    w = torch.sigmoid(lse.float() - sinks.float()[None, :])
    return out.float() * w[:, :, None]


def flash_supported(q: torch.Tensor) -> bool:
    """Whether the flash backends take q `[L, h, D]`: CUDA, bf16/fp16, D <= 256, D % 8 == 0."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d <= 256 and d % 8 == 0


def _lse_rows(lse: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """A backend's LSE as `[h, L]` fp32: `[h, L]` as is (unpadded varlen), or `[S, h, max]`
    (padded per segment; a trailing 1 dropped) cut back to each segment's rows."""
    if lse.dim() == 4:
        lse = lse[..., 0]
    if lse.dim() == 2:
        return lse.float()
    parts = [lse[i, :, : b - a] for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat(parts, dim=1).float()


def torch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The "flash" backend (see the module docstring): one varlen call, `num_splits=1`."""
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, longest, longest, 0.0, False, False, scale=scale, num_splits=1)
    return out, lse


def torch_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The "cudnn" backend (see the module docstring): one call per segment."""
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        qh, kh, vh = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qh, kh, vh, None, True, 0.0, False, False, scale=scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(_lse_rows(lse, [0, b - a]))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def math_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition (fp64 scores and softmax, per segment): the stand-in backend of the CPU
    tests and the reference of `gpu_check`. Returns out in q's dtype and lse `[h, L]` fp32."""
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * scale
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v[a:b].double()))
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1).float()


BACKENDS: dict[str, FlashBackend] = {"flash": torch_flash, "cudnn": torch_cudnn}


def segment_bounds(segments: list[tuple[int, int]], length: int) -> list[int]:
    """The cumulative boundaries `[0, b1, ..., L]` of the non-empty `(start, stop)`
    segments, which must cover `[0, length)` in order; ValueError naming `segments`."""
    pos, bounds = 0, [0]
    for seg in segments:
        if len(seg) != 2 or seg[0] != pos or seg[1] < seg[0]:
            raise ValueError(f"segments must cover [0, {length}) in order, got {segments!r}")
        if seg[1] > pos:
            bounds.append(seg[1])
        pos = seg[1]
    if pos != length:
        raise ValueError(f"segments must cover [0, {length}) in order, got {segments!r}")
    return bounds


def flash_segment_attention(
    qkv: torch.Tensor, segments: list[tuple[int, int]], sinks: torch.Tensor, scale: float,
    backend: FlashBackend = torch_flash,
) -> torch.Tensor:
    """Each packed segment attends within itself through `backend`, the sink applied from
    the LSE (`apply_sink`). qkv `[L, 3, h, D]` (KV heads already repeated), segments host
    `(start, stop)` covering `[0, L)` in order, sinks `[h]` fp32 -> `[L, h, D]` in qkv's
    dtype (the backend's out, then the sink factor in fp32, rounded once more)."""
    length = qkv.shape[0]
    bounds = segment_bounds(segments, length)
    if len(bounds) == 1:
        return qkv.new_zeros((0, *qkv.shape[2:]))
    q, k, v = (qkv[:, i].contiguous() for i in range(3))
    out, lse = backend(q, k, v, bounds, scale)
    return apply_sink(out, _lse_rows(lse, bounds).transpose(0, 1), sinks).to(qkv.dtype)


# ---------------------------------------------------------------------------- the proof
def proof_key(device: torch.device | str = "cuda", backend: str = "flash") -> str:
    """The device and stack a proof holds for: GPU name, torch, CUDA, cuDNN, the backend."""
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return (f"{name} | torch {torch.__version__} | cuda {torch.version.cuda} | "
            f"cudnn {torch.backends.cudnn.version()} | {backend}")  # type: ignore[no-untyped-call]


def proof_path(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(os.path.expanduser(str(cache_dir))) / PROOF_FILE


def read_proof(cache_dir: str | os.PathLike[str], key: str) -> bool:
    """Whether `gpu_check` recorded the invariance probe of `key` passing (an unreadable
    or missing record is no proof)."""
    try:
        record = json.loads(proof_path(cache_dir).read_text())
    except (OSError, ValueError):
        return False
    entry = record.get(key) if isinstance(record, dict) else None
    return isinstance(entry, dict) and entry.get("invariant") is True


def write_proof(cache_dir: str | os.PathLike[str], key: str, invariant: bool,
                detail: str) -> Path:
    """Record `key`'s probe result (atomically, other keys kept); returns the file."""
    path = proof_path(cache_dir)
    try:
        record = json.loads(path.read_text())
        record = record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        record = {}
    record[key] = {"invariant": bool(invariant), "detail": detail}

    def write(tmp: str) -> None:
        Path(tmp).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    atomic_write(path, write)
    return path


def resolve_attention(choice: str, device: str, cache_dir: str | os.PathLike[str]) -> str:
    """The attention path of `--attention choice` on ranks of `device` ("cpu"/"cuda"):
    "triton" (the default path: the Triton kernel on CUDA, the torch definition on CPU) or
    "flash". ValueError naming `attention` for an unknown choice or flash off CUDA."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {choice!r}")
    if choice == "flash" and device != "cuda":
        raise ValueError(f"attention=flash needs CUDA ranks (FlashAttention has no CPU "
                         f"kernel), this deployment runs on {device}; use auto or triton")
    if choice == "auto":  # the device is asked its name only where a record exists
        proven = device == "cuda" and proof_path(cache_dir).is_file() and read_proof(
            cache_dir, proof_key())
        return "flash" if proven else "triton"
    return choice
