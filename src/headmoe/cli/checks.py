"""`headmoe generate` checks that run in the launching process before any rank starts or
any weight is built: the prompt source, the output path, checkpoint values (the request
itself is admission's, `headmoe.admission`). Each raises `UserError` naming the flag / file / value and what to do.

The flags these checks read (``--prompt-file``, ``--overwrite``, ``--check-weights``) are
declared in `headmoe.cli.flags`.
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
from headmoe.models.magi2 import check_checkpoint
from headmoe.moe.fp8 import FP8_DTYPE, fp8_nan
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.request import MAX_PROMPT_CHARS

#: the most bytes --prompt-file reads (4 UTF-8 bytes per character at most)
MAX_PROMPT_FILE_BYTES = 4 * MAX_PROMPT_CHARS


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
        with open(Path(path).expanduser(), "rb") as f:
            data = f.read(MAX_PROMPT_FILE_BYTES + 1)  # /dev/zero stops here
    except OSError as e:
        raise UserError(f"--prompt-file {path!r} cannot be read ({e.strerror}), "
                        "pass an existing readable text file") from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise UserError(f"--prompt-file {path!r} is over {MAX_PROMPT_FILE_BYTES:,} bytes (a "
                        f"prompt may have {MAX_PROMPT_CHARS:,} characters), pass a shorter "
                        "file")
    try:
        return data.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt-file {path!r} is not valid UTF-8 (byte {e.start}), "
                        "save it as UTF-8") from None


def check_args(args: argparse.Namespace) -> None:
    """The checks that need only the flags; sets ``args.prompt`` from --prompt-file."""
    args.prompt = read_prompt(args)
    if args.negative_prompt is not None:
        _utf8(args.negative_prompt, "--negative-prompt")


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


def check_weights(dep: Deployment, scan: bool) -> None:
    """The transformer checkpoint's headers (a bare checkpoint's: a release's were checked
    when its `Deployment` was built) and, with ``scan`` (``--check-weights``), every tensor
    of it and of the release's components; refused naming the file or tensor."""
    if dep.release is not None and not scan:
        return
    headers, report = check_checkpoint(dep.model_config, dep.checkpoint)  # headers only
    report_conversions(report)
    if scan:
        scan_weights(dep.checkpoint, headers, report.prefix)
        if dep.release is not None:
            scan_components(dep.release)


def print_admitted(notes: list[str], dep: Deployment) -> None:
    """Admission's notes on the request, and the warning of a release whose refiner/ failed
    its checks (the request was admitted without it), on stderr."""
    for note in notes:
        print(f"headmoe: note: {note}", file=sys.stderr)
    if dep.refiner_problem:
        print(f"headmoe: warning: refiner/ is not used (a run of the refiner stage is "
              f"refused): {dep.refiner_problem}", file=sys.stderr)


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
    if t.dtype == FP8_DTYPE:  # E4M3 has NaN bytes only, and torch no isfinite for it
        return "NaN" if bool(fp8_nan(t).any()) else None
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
    """The weight files of the release's text encoder, chosen video decoder, audio decoder
    and image encoder (vae/, when the run uses it; each checked to lie in its folder)."""
    from headmoe.release import audio_vae, text_encoder, turbo_vae, wan_vae

    video = turbo_vae.CHECKPOINT_FILE if release.video_decoder == "turbo" else \
        wan_vae.CHECKPOINT_FILE
    text = sorted(set(text_encoder.weight_files(release.text_encoder).values()))
    files = [*text, os.path.join(release.video_decoder_path, video),
             os.path.join(release.audio_decoder, audio_vae.WEIGHTS_FILE)]
    if release.image_encoder is not None:
        vae = os.path.join(release.image_encoder, wan_vae.CHECKPOINT_FILE)
        files += [] if vae in files else [vae]
    return files


def scan_components(release: Any) -> None:
    """``--check-weights`` on a release folder: every tensor of the text encoder, the video
    and audio decoders and the image encoder (read safely,
    `headmoe.release.weights.read_tensors`), then of the refiner (`scan_weights`);
    NaN/Inf refused, naming the file."""
    from headmoe.release.weights import read_tensors

    for file in component_files(release):
        bad = [f"{name} ({kind})" for name, t in _tensors(read_tensors(file))
               if (kind := _nonfinite(t))]
        _refuse_nonfinite(f"component checkpoint {file!r}", bad)
    if release.refiner is not None:  # the refiner's checkpoint, as the transformer's
        from headmoe.models.refiner import check_refiner_checkpoint

        headers, report = check_refiner_checkpoint(release.refiner_config, release.refiner)
        scan_weights(release.refiner, headers, report.prefix)
