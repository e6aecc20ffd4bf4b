"""`headmoe generate` checks that run in the launching process before any rank starts or
any weight is built: prompts, frame count, seed, output path, memory estimate, checkpoint
values. Each raises `UserError` naming the flag / file / value and what to do.

`add_arguments` adds the flags these checks read (``--prompt-file``, ``--overwrite``,
``--max-memory-gib``, ``--check-weights``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from headmoe.errors import UserError
from headmoe.files import listing
from headmoe.pipeline.seeding import SEED_LIMIT

#: output frames per latent frame after the first (the video decoders' temporal stride)
TEMPORAL_STRIDE = 4
GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of these checks, on the `generate` parser."""
    group = next((g for g in p._mutually_exclusive_groups
                  if any(a.dest == "prompt" for a in g._group_actions)), p)
    group.add_argument("--prompt-file", default=None,
                       help="read the prompt from this UTF-8 file (instead of --prompt)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output file (default: refuse)")
    p.add_argument("--max-memory-gib", type=float, default=None,
                   help="memory one rank may use, replacing the detected limit (free device "
                   "memory, or available host memory / local ranks on CPU)")
    p.add_argument("--check-weights", action="store_true",
                   help="read every tensor of the transformer checkpoint (and of a release's text "
                   "encoder and video and audio decoders) first and refuse NaN/Inf values")


def _utf8(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{what} is not valid UTF-8, byte {e.start} ({text[e.start]!r} from the command "
            "line's encoding), pass UTF-8 text or use --prompt-file with a UTF-8 file"
        ) from None
    return text


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from ``--prompt`` or ``--prompt-file`` (exactly one), checked UTF-8."""
    given = getattr(args, "prompt", None)
    path = getattr(args, "prompt_file", None)
    if (given is None) == (path is None):
        raise UserError("give exactly one of --prompt and --prompt-file, "
                        f"got {'both' if path else 'neither'}, e.g. --prompt 'a red fox'")
    if path is None:
        return _utf8(given, "--prompt")
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise UserError(f"--prompt-file {path!r} cannot be read ({e.strerror}), "
                        "pass an existing readable text file") from None
    try:
        return data.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt-file {path!r} is not valid UTF-8 (byte {e.start}), "
                        "save it as UTF-8") from None


def check_num_frames(n: int) -> None:
    """``n`` must be ``4k + 1`` (the decoders keep the first frame, then 4 per latent)."""
    if n >= 1 and (n - 1) % TEMPORAL_STRIDE == 0:
        return
    low = (max(n, 1) - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1
    near = [1] if n < 1 else [low, low + TEMPORAL_STRIDE]
    raise UserError(f"--num-frames {n} is not of the form 4k+1 (the video decoder makes 1 + 4k "
                    f"frames), use {' or '.join(map(str, near))}")


def check_seed(seed: int, dp_size: int) -> None:
    """Every DP group's seed (``seed + k``) must lie in [0, 2**63)."""
    if not seed >= 0 or seed + dp_size - 1 >= SEED_LIMIT:
        top = SEED_LIMIT - dp_size
        raise UserError(f"--seed {seed} is outside [0, {top}] (data-parallel group k uses seed "
                        f"+ k, all below 2**63), pick a seed in that range")


def check_noise_device(noise_device: str) -> None:
    """``--noise-device cuda`` needs a CUDA device here (the ranks draw on theirs)."""
    import torch

    if noise_device == "cuda" and not torch.cuda.is_available():
        raise UserError("--noise-device cuda draws the noise on the GPU, but no CUDA device "
                        "is available here; use --noise-device cpu")


def check_args(args: argparse.Namespace) -> None:
    """The checks that need only the flags; sets ``args.prompt`` from --prompt-file."""
    args.prompt = read_prompt(args)
    _utf8(args.negative_prompt, "--negative-prompt")
    check_num_frames(args.num_frames)
    check_seed(args.seed, max(args.data_parallel_size, 1))
    if args.max_memory_gib is not None and not args.max_memory_gib > 0:
        raise UserError(f"--max-memory-gib must be > 0, got {args.max_memory_gib!r}")


def _output_files(output: Path, dp_size: int) -> list[Path]:
    from headmoe.pipeline.job import output_path

    mp4s = [output_path(output, k, dp_size) for k in range(dp_size)]
    return [f for m in mp4s for f in (m, m.with_suffix(".json"))]


def check_output(output: Path, overwrite: bool, dp_size: int) -> None:
    """The folder of ``output`` exists and is writable; no output is a folder; an existing
    file is refused unless ``overwrite``."""
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"--output {str(output)!r}: folder {str(parent)!r} does not exist, "
                        "create it first or pick another path")
    try:  # a real probe: permission bits do not stop root, read-only mounts stop everyone
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".headmoe-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"--output {str(output)!r}: folder {str(parent)!r} is not writable "
                        f"({e.strerror}), pick a writable folder") from None
    for f in _output_files(output, dp_size):
        if f.is_dir():
            raise UserError(f"--output {str(output)!r}: {str(f)!r} is a folder, "
                            "pick a file path ending in .mp4")
        if (f.exists() or f.is_symlink()) and not overwrite:
            raise UserError(f"--output {str(output)!r}: {str(f)!r} already exists, "
                            "pass --overwrite to replace it or pick another path")


def check_memory(args: argparse.Namespace, model: Any, request: Any, parallel: Any,
                 world: int) -> None:
    """Refuse a request whose per-rank memory estimate exceeds the limit (see
    `headmoe.planner.memory`; with ``--offload-layers`` the streamed estimate)."""
    import torch

    from headmoe.cli.plan import stream_settings
    from headmoe.planner.memory import check_fits, estimate_memory, memory_limit
    from headmoe.planner.request import RequestShape

    shape = RequestShape.from_media(
        height=request.height, width=request.width, num_frames=request.num_frames,
        fps=request.fps, text_tokens=256, uncond_text_tokens=256)
    est = estimate_memory(model, shape, parallel, request.torch_dtype,
                          (request.num_frames, request.height, request.width),
                          request.audio_samples(44100), stream=stream_settings(args, model.num_layers))
    if args.max_memory_gib is not None:
        limit, source = int(args.max_memory_gib * GIB), "--max-memory-gib"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        limit, source = memory_limit(local, torch.cuda.is_available())
    what = (f"--model {args.model} (config {getattr(model, 'name', '?')}) at "
            f"{request.num_frames} frames of {request.width}x{request.height}")
    try:
        check_fits(est, limit, source, what)
    except ValueError as e:
        raise UserError(str(e)) from None


def report_conversions(report: Any) -> None:
    """Say which checkpoint tensors are cast on load (stored in another float dtype)."""
    conv = getattr(report, "converted", [])
    if conv:
        name, stored, target = conv[0]
        print(f"headmoe: note: {len(conv)} checkpoint tensor(s) are stored in another float "
              f"dtype than the model config says and are converted on load (e.g. {name}: "
              f"{stored} -> {target})", file=sys.stderr)


def _nonfinite(t: Any) -> str | None:
    """"NaN" / "Inf" when the float tensor ``t`` holds one, else None."""
    import torch

    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    if bool(torch.isfinite(t).all()):
        return None
    return "NaN" if bool(torch.isnan(t).any()) else "Inf"


def _refuse_nonfinite(what: str, bad: list[str]) -> None:
    if bad:
        raise UserError(f"{what} holds non-finite values in " + listing("tensor(s)", bad)
                        + ", replace or repair it")


def scan_weights(checkpoint: str, headers: dict[str, Any], prefix: str) -> None:
    """``--check-weights``: read every tensor once; refuse NaN/Inf naming the tensors."""
    from safetensors import safe_open

    bad: list[str] = []
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in headers.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for name in names:
                kind = _nonfinite(f.get_tensor(prefix + name if prefix + name in keys else name))
                if kind:
                    bad.append(f"{prefix + name} ({kind}, in {os.path.basename(file)})")
    _refuse_nonfinite(f"checkpoint {checkpoint!r}", bad)


def _tensors(obj: Any, name: str = "") -> Any:
    """(name, tensor) of every tensor in nested dicts/lists (a decoder checkpoint)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{name}.{k}" if name else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{name}.{i}")
    else:
        yield name, obj


def component_files(release: Any) -> list[str]:
    """The weight files of the release's text encoder, chosen video decoder and audio
    decoder (each checked to lie in its folder)."""
    from headmoe.pipeline import audio_vae, text_encoder, turbo_vae, wan_vae

    video = turbo_vae.CHECKPOINT_FILE if release.video_decoder == "turbo" else \
        wan_vae.CHECKPOINT_FILE
    text = sorted(set(text_encoder.weight_files(release.text_encoder).values()))
    return [*text, os.path.join(release.video_decoder_path, video),
            os.path.join(release.audio_decoder, audio_vae.WEIGHTS_FILE)]


def scan_components(release: Any) -> None:
    """``--check-weights`` on a release folder: every tensor of the text encoder and the
    video and audio decoders (read safely, `headmoe.pipeline.weights.read_tensors`);
    NaN/Inf refused."""
    from headmoe.pipeline.weights import read_tensors

    for file in component_files(release):
        bad = [f"{name} ({kind})" for name, t in _tensors(read_tensors(file))
               if (kind := _nonfinite(t))]
        _refuse_nonfinite(f"component checkpoint {file!r}", bad)
