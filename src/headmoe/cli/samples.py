"""``headmoe generate --samples FILE``: several requests on one model load.

The file is JSON lines: one object per line, one request each (blank lines are skipped;
lines are numbered from 1 as in an editor). A line's keys are the request fields of
``headmoe generate``'s flags, as the HTTP API names them (`headmoe.admission.INPUT_FIELDS`:
``prompt`` (required), ``negative_prompt``, ``seed``, ``num_inference_steps``, ``height``,
``width``, ``size``, ``resolution``, ``num_frames``, ``seconds``, ``fps``, ...; not
``dtype``, which is the command's ``--dtype`` for every line: one model load is one dtype),
plus ``image`` (a path, as ``--image``) and ``output`` (a path ending in ``.mp4``). The
request flags given on the command line are every line's defaults (a line's key wins).

Outputs: a line's ``output``, else ``--output``'s name with the line number before its
suffix (``--output out.mp4``: line 3 writes ``out.3.mp4`` and ``out.3.json``; with DP
groups each ``.dp<k>`` as a single ``generate``). Two lines with the same file, and a file
that exists without ``--overwrite``, are refused.

Every line is read and admitted (the one admission, `headmoe.admission.admit`, on the one
`Deployment`) before any rank starts; a bad line is refused as ``--samples line N:
<field>=<value> ...``, nothing runs. Each line's video and audio are the bytes of a single
``generate`` of that request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headmoe.admission import INPUT_FIELDS, Admitted, admit, check_given
from headmoe.cli import checks
from headmoe.errors import Refusal, UserError
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.request import show

#: the keys a line may give besides the request fields, and the request field it may not
LINE_KEYS = ("image", "output")
COMMAND_FIELDS = ("dtype",)
#: the largest samples file read (bytes)
MAX_SAMPLES_BYTES = 64 << 20


@dataclass(frozen=True)
class Sample:
    """One line: its number, its request fields (the command's defaults under them), its
    image path (or None) and its output mp4."""

    line: int
    given: dict[str, object]
    image: str | None
    output: Path


def _refuse(line: int, text: str) -> UserError:
    return UserError(f"--samples line {line}: {text}")


def read_lines(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of ``path``; `UserError` naming the
    file, or the line and what is wrong with it."""
    try:
        with open(Path(path).expanduser(), "rb") as f:
            data = f.read(MAX_SAMPLES_BYTES + 1)
    except OSError as exc:
        raise UserError(f"--samples {path!r} cannot be read ({exc.strerror}), pass a JSON "
                        "lines file") from None
    if len(data) > MAX_SAMPLES_BYTES:
        raise UserError(f"--samples {path!r} is over {MAX_SAMPLES_BYTES:,} bytes")
    out = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _refuse(n, f"not a JSON object ({exc})") from None
        if not isinstance(obj, dict):
            raise _refuse(n, f"must be a JSON object of request fields, got {show(obj)}")
        out.append((n, obj))
    if not out:
        raise UserError(f"--samples {path!r} has no request (one JSON object per line)")
    return out


def parse_sample(line: int, obj: Mapping[str, Any], defaults: Mapping[str, object],
                 output: Path, image: str | None = None) -> Sample:
    """The `Sample` of line ``line`` (``output``: ``--output``; ``image``: ``--image``, the
    default of the line's ``image``), its request fields checked
    (`check_given`: every field's rule and the contradictions); `UserError` naming the line
    and the field."""
    for key, value in obj.items():
        if key in COMMAND_FIELDS:
            raise _refuse(line, f"{key}={show(value)}: {key} is the command's (--{key}) for "
                                "every line, not a line's field")
        if key not in INPUT_FIELDS and key not in LINE_KEYS:
            raise _refuse(line, f"unknown field {key}={show(value)} (a line gives request "
                                "fields, image and output)")
    for key in LINE_KEYS:
        if key in obj and not isinstance(obj[key], str):
            raise _refuse(line, f"{key}={show(obj[key])}: must be a path (a string)")
    given = {**defaults, **{k: v for k, v in obj.items() if k not in LINE_KEYS}}
    try:
        check_given(given)
    except Refusal as exc:
        raise _refuse(line, exc.message) from None
    if "prompt" not in given:
        raise _refuse(line, "prompt is required")
    out = Path(obj["output"]) if "output" in obj else output.with_name(
        f"{output.stem}.{line}{output.suffix}")
    if out.suffix.lower() != ".mp4":
        raise _refuse(line, f"output={show(str(out))} must end in .mp4")
    return Sample(line, given, obj.get("image", image), out)


def read_samples(args: argparse.Namespace, defaults: Mapping[str, object]) -> list[Sample]:
    """Every line of ``args.samples`` parsed (`parse_sample`), outputs checked: each file
    (mp4 and sidecar, each DP group's) of one line only, and none there already unless
    ``args.overwrite`` (`checks.check_output`)."""
    output = Path(args.output)
    if output.suffix.lower() != ".mp4":
        raise ValueError(f"output must end in .mp4, got {args.output!r}")
    dp = args.data_parallel_size
    image = getattr(args, "image", None)
    samples = [parse_sample(n, obj, defaults, output, image)
               for n, obj in read_lines(args.samples)]
    owner: dict[Path, int] = {}
    for s in samples:
        for f in checks.output_files(s.output, dp):
            first = owner.setdefault(f.resolve(), s.line)
            if first != s.line:
                raise _refuse(s.line, f"output {str(f)!r} is also line {first}'s; give each "
                                      "line its own output")
        try:
            checks.check_output(s.output, args.overwrite, dp)
        except UserError as exc:
            raise _refuse(s.line, str(exc)) from None
    return samples


def admit_samples(samples: list[Sample], dep: Deployment, origin: str) -> list[Admitted]:
    """Every sample admitted on ``dep``; `UserError` naming the first refused line. When a
    line runs the refiner, the refiner stays loaded for every line: then each is admitted
    with its weights resident (`Deployment.resident_refiner`)."""
    def run(d: Deployment) -> list[Admitted]:
        out = []
        for s in samples:
            try:
                out.append(admit(s.given, d, origin, image=s.image is not None))
            except Refusal as exc:
                raise _refuse(s.line, exc.message) from None
        return out

    admitted = run(dep)
    if dep.has_refiner and any(a.refiner is not None for a in admitted):
        admitted = run(dataclasses.replace(dep, resident_refiner=True))
    return admitted
