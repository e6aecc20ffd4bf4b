"""`headmoe quantize --model RELEASE --output DIR`: a release folder with FP8 routed experts
(`headmoe.release.quantize.quantize_release`; docs/fp8.md). `generate` and `serve` read
the output folder as any release; its experts' format comes from its tensor names."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from headmoe.cli import flags
from headmoe.release.folder import tiny_release
from headmoe.release.quantize import quantize_release


def register(subparsers: Any) -> None:
    """Add the ``quantize`` subcommand."""
    p = subparsers.add_parser(
        "quantize",
        help="write a release folder whose routed experts are FP8 (E4M3 + fp32 scales)",
        description="Quantize a bf16 release's routed experts (preview/ *.moe_mlp.W_gate, "
        "W_up, W_down) to float8 E4M3 with one fp32 scale per (expert, output channel), "
        "the rule of --expert-format fp8, and write a release folder in the same layout: "
        "preview/ as safetensors shards and an index, every other file hard-linked (or "
        "copied). 'headmoe generate --model DIR' reads it; the result is the same as "
        "--expert-format fp8 on the source, without quantizing at every start.",
    )
    flags.add(p, "model", "cache_dir", model={
        "default": None, "required": True,
        "help": "the bf16 release folder to read ('tiny': the embedded tiny release)"})
    p.add_argument("--output", required=True, metavar="DIR", help=(
        "the folder to write (must not exist, or be empty); built beside it and renamed "
        "in one step"))
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Quantize (a refused folder or output is reported by `headmoe.cli.errors`)."""

    def say(text: str) -> None:
        if not args.no_progress:
            print(f"headmoe: quantize: {text}", file=sys.stderr, flush=True)

    source = tiny_release(args.cache_dir) if args.model == "tiny" else args.model
    out = quantize_release(source, args.output, say)
    print(f"wrote {str(out)!r}: run it with 'headmoe generate --model {out}'")
    return 0
