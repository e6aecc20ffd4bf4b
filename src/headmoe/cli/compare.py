"""`headmoe compare`: run one request under several layouts and put them side by side.

    headmoe compare --layouts sp4 sp4,ep2 sp2,cfg2 sp4,ep2,sp_group [--repeat K] [--json]
        [--output-dir DIR] --prompt "..." [any other `headmoe generate` flag]

Each run is a fresh `headmoe generate --nproc N` subprocess (N = the layout's world size)
writing an mp4 and its JSON sidecar; the table is read from the sidecars. With `--repeat K`
the runs are interleaved round-robin (A B C A B C ...), so drift of the machine over time
spreads over every layout instead of biasing one. Layout names: see
`headmoe.planner.layouts` ("sp4,ep2,sp_group"). The generate flags that set the layout,
`--nproc`, `--output` and `--no-progress` belong to compare.

Columns: per-step time (max over ranks, mean over the steps after the first, mean over the
repeats), busiest-rank MoE rows per call, MoE and Ulysses bytes sent per rank per step (the
busiest sender), the hashes and whether they equal the first layout's, and whether every
rank's counters equal the planner's prediction for the same request ("n/a" for a model
that is not a preset).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from headmoe.admission import admit, byte_tokens
from headmoe.cli import checks, flags, generate
from headmoe.cli.errors import run_guarded
from headmoe.config import MIB, ParallelConfig, is_int
from headmoe.deployment import build_deployment
from headmoe.distributed.counters import Counters
from headmoe.errors import RuntimeFault, UserError
from headmoe.models.magi2.config import PRESETS, get_config
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT
from headmoe.pipeline.request import DTYPES
from headmoe.planner.layouts import layout_name, parse_layout
from headmoe.planner.memory import StreamSettings, streamed_counts
from headmoe.planner.predict import forward_counters, layout_topology
from headmoe.planner.request import RequestShape

#: generate options compare sets itself (by argparse dest)
OWN_DESTS = frozenset(
    {
        *flags.LAYOUT_FIELDS,
        "nproc",
        "output",
        "no_progress",
        "help",
    }
)

Runner = Callable[[list[str]], None]


def _generate_actions() -> list[argparse.Action]:
    from headmoe.cli.main import Parser

    top = Parser()
    sub = top.add_subparsers()
    generate.register(sub)
    return [a for a in sub.choices["generate"]._actions if a.dest not in OWN_DESTS]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `compare` (with every `generate` flag it forwards); handler `args.run`."""
    p = subparsers.add_parser(
        "compare",
        help="run one request under several layouts; compare times, bytes, hashes",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        required=True,
        metavar="LAYOUT",
        help='layout names, e.g. "sp4" "sp4,ep2" "sp2,cfg2" "sp4,ep2,sp_group"',
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per layout, interleaved")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=3600.0,
        help="seconds one generate run may take before it is killed (default 3600)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--output-dir",
        default=None,
        help="keep the mp4s and sidecars here (default: a temporary folder)",
    )
    forwarded = []
    for action in _generate_actions():
        p._add_action(action)
        forwarded.append(action)
    p.set_defaults(run=run, _forwarded=forwarded)
    return p


register = add_parser
"""The name `headmoe.cli.main` looks for."""


def generate_flags(args: argparse.Namespace) -> list[str]:
    """The forwarded `generate` flags whose values differ from generate's defaults."""
    out: list[str] = []
    for a in args._forwarded:
        value = getattr(args, a.dest)
        if value == a.default and not a.required:
            continue
        flag = a.option_strings[-1]
        out += [flag] if a.nargs == 0 else [f"{flag}={value}"]  # "=": values may start with -
    return out


def run_order(num_layouts: int, repeat: int) -> list[tuple[int, int]]:
    """`(repeat index, layout index)` of every run, round-robin: all layouts once, then
    again, `repeat` times."""
    return [(k, i) for k in range(repeat) for i in range(num_layouts)]


def subprocess_runner(cmd: list[str], timeout: float | None = None) -> None:
    """Run one `generate` command; raise `RuntimeError` with its output tail on failure, or
    when it runs longer than `timeout` seconds (it is then killed)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"") + (e.stderr or b""))[-4000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise RuntimeFault(f"{' '.join(cmd)} ran past --run-timeout={timeout} s, raise "
                           f"--run-timeout or shrink the request; its output ended: "
                           f"{_error_line(tail)}") from None
    if proc.returncode:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeFault(f"{' '.join(cmd)} exited with {proc.returncode}: {_error_line(tail)}")


def _error_line(tail: str) -> str:
    """The run's own ``headmoe: error:`` line, else the last line of its output."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    errors = [ln.removeprefix("headmoe: error: ") for ln in lines if ln.startswith("headmoe:")]
    return (errors or lines or ["(no output)"])[-1]


def sidecar_file(output: Path, parallel: ParallelConfig) -> Path:
    """The sidecar of DP group 0 of a run writing `output`."""
    stem = output.stem + (".dp0" if parallel.data_parallel_size > 1 else "")
    return output.with_name(stem + ".json")


def predicted_summary(
    side: dict[str, Any], parallel: ParallelConfig, rank: int
) -> dict[str, Any] | None:
    """The planner's `Counters.summary()` for `rank` over the run's steps (None for a model
    that is not a preset)."""
    name = side["model"]["name"]
    if name not in PRESETS:
        return None
    req = side["request"]
    if side.get("text"):  # the text encoder's own token counts (a release's components)
        tokens = (side["text"]["prompt"]["kept"], side["text"]["negative_prompt"]["kept"])
    else:  # the stand-in byte encoder
        tokens = (byte_tokens(req["prompt"]), byte_tokens(req["negative_prompt"]))
    shape = RequestShape(tuple(side["latents"]["video"][:3]), side["latents"]["audio"][0], tokens)
    model, dtype = get_config(name), DTYPES[req["dtype"]]
    one = forward_counters(model, shape, parallel, rank, dtype)
    steps = req["num_inference_steps"]
    streamed = []
    if side["layout"].get("offload_layers"):  # --offload-layers: the weight bytes moved
        ep = layout_topology(model, parallel).coords(rank).ep
        streamed = streamed_counts(model, parallel.resolved_expert_parallel_size(), ep, dtype,
                                   StreamSettings(side["layout"]["resident_layers"]), steps,
                                   side["model"].get("expert_format", DEFAULT_EXPERT_FORMAT))
    return Counters(one.moe_rows * steps, one.exchanges * steps, streamed).summary()


def summarize(
    name: str, parallel: ParallelConfig, sides: list[dict[str, Any]], first: dict[str, Any] | None
) -> dict[str, Any]:
    """One table row from a layout's sidecars (`first`: the first layout's first sidecar)."""
    side = sides[0]
    steps = side["request"]["num_inference_steps"]
    per_run = []
    for s in sides:
        mx = s["step_times_s"]["max"]
        later = mx[1:] or mx
        per_run.append(sum(later) / len(later))
    counters = side["counters"]

    def sent(*kinds: str) -> int:
        return (
            max(
                sum(c["exchanges"].get(k, {}).get("bytes_sent", 0) for k in kinds)
                for c in counters.values()
            )
            // steps
        )

    ref = first or side
    same = all(
        (s["video_sha256"], s["audio_sha256"]) == (ref["video_sha256"], ref["audio_sha256"])
        for s in sides
    )
    predicted = [
        (predicted_summary(s, parallel, int(r)), c) for s in sides for r, c in s["counters"].items()
    ]
    match = None if any(p is None for p, _ in predicted) else all(p == c for p, c in predicted)
    return {
        "layout": name,
        "world_size": parallel.world_size,
        "step_time_s": sum(per_run) / len(per_run),
        "step_time_s_per_run": per_run,
        "busiest_moe_rows": max(c["moe_rows_max_per_call"] for c in counters.values()),
        "moe_bytes_sent_per_rank_per_step": sent("moe_scatter", "moe_gather"),
        "ulysses_bytes_sent_per_rank_per_step": sent("ulysses_in", "ulysses_out"),
        "bytes_sent_per_rank_per_step": sent(
            *{k for c in counters.values() for k in c["exchanges"]}
        ),
        "video_sha256": side["video_sha256"],
        "audio_sha256": side["audio_sha256"],
        "same_as_first": same,
        "counters_match_plan": match,
    }


def compare(
    layouts: Sequence[str],
    gen_flags: list[str],
    repeat: int,
    out_dir: Path,
    runner: Runner = subprocess_runner,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every layout `repeat` times (interleaved) and return one row per layout.
    Layout names are validated before anything runs (`ValueError`)."""
    parallels = [parse_layout(n) for n in layouts]
    if not is_int(repeat) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    names = [layout_name(p) for p in parallels]
    if len(set(names)) != len(names):
        raise ValueError(f"layouts must be distinct, got {list(layouts)!r}")
    sides: list[list[dict[str, Any]]] = [[] for _ in layouts]
    for k, i in run_order(len(layouts), repeat):
        output = out_dir / f"{names[i].replace(',', '_')}.r{k}.mp4"
        cmd = [
            sys.executable,
            "-m",
            "headmoe.cli.main",
            "generate",
            *gen_flags,
            *flags.layout_argv(parallels[i]),
            "--output",
            str(output),
            "--no-progress",
        ]
        if log:
            log(f"[{k + 1}/{repeat}] {names[i]}: {' '.join(cmd[2:])}")
        runner(cmd)
        sides[i].append(json.loads(sidecar_file(output, parallels[i]).read_text()))
    first = sides[0][0]
    return [summarize(n, p, s, first) for n, p, s in zip(names, parallels, sides)]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "layout",
        "ranks",
        "step s (max rank, mean after 1st)",
        "busiest MoE rows/call",
        "MoE MiB sent/rank/step",
        "Ulysses MiB sent/rank/step",
        "video_sha256",
        "audio_sha256",
        "same bytes as first",
        "counters = plan",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = (
            r["layout"],
            str(r["world_size"]),
            f"{r['step_time_s']:.3f}",
            f"{r['busiest_moe_rows']:,}",
            f"{r['moe_bytes_sent_per_rank_per_step'] / MIB:.2f}",
            f"{r['ulysses_bytes_sent_per_rank_per_step'] / MIB:.2f}",
            r["video_sha256"][:16],
            r["audio_sha256"][:16],
            "yes" if r["same_as_first"] else "**NO**",
            {True: "yes", False: "**NO**", None: "n/a"}[r["counters_match_plan"]],
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_request(args: argparse.Namespace) -> None:
    """Refuse, before any run: a layout the model cannot run (named), and a request the
    forwarded flags give that admission refuses under any of the layouts (the model's
    configuration only: each run's own ``generate`` checks its world, weights and memory
    budget)."""
    dep = build_deployment(flags.options_of(args, config_only=True))
    model = dep.model_config
    parallels = []
    for name in args.layouts:
        try:
            parallels.append(layout_topology(model, parse_layout(name)).config)
        except ValueError as e:
            raise UserError(f"--layouts {name!r} cannot run model {model.name!r}: {e}, "
                            "drop or fix that layout (nothing has run)") from None
    prompt = checks.read_prompt(argparse.Namespace(prompt=args.prompt,
                                                   prompt_file=args.prompt_file))
    given = {**flags.given_request(args), "prompt": prompt}
    for parallel in parallels:
        admit(given, dataclasses.replace(dep, parallel=parallel))


def run(args: argparse.Namespace, runner: Runner | None = None) -> int:
    """Run `compare` for parsed `args`; returns 0 when every layout produced the first
    layout's bytes, 1 otherwise, 2 on bad input or a failed run. `runner` defaults to
    `subprocess_runner` bounded by `--run-timeout`."""
    if not args.run_timeout > 0:
        raise UserError(f"--run-timeout must be > 0, got {args.run_timeout!r}, e.g. 3600")
    runner = runner or functools.partial(subprocess_runner, timeout=args.run_timeout)
    check_request(args)  # every layout and the forwarded flags, before any run
    if args.output_dir is not None and Path(args.output_dir).exists() \
            and not Path(args.output_dir).is_dir():
        raise UserError(f"--output-dir {args.output_dir!r} is a file, pick a folder")
    flags = generate_flags(args) + (["--debug"] if getattr(args, "debug", False) else [])
    with tempfile.TemporaryDirectory(prefix="headmoe-compare-") as tmp:
        out_dir = Path(args.output_dir or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = compare(
            args.layouts,
            flags,
            args.repeat,
            out_dir,
            runner,
            log=lambda m: print(m, file=sys.stderr),
        )
    if args.json:
        print(
            json.dumps({"generate_flags": flags, "repeat": args.repeat, "layouts": rows}, indent=2)
        )
    else:
        print(format_table(rows))
    return 0 if all(r["same_as_first"] for r in rows) else 1


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    """Entry point for tests and `python -m headmoe.cli.compare`."""
    from headmoe.cli.main import Parser

    parser = Parser(prog="headmoe")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", *(sys.argv[1:] if argv is None else argv)])
    return run_guarded(lambda: run(args, runner), "compare", False)


if __name__ == "__main__":
    sys.exit(main())
