"""`headmoe <subcommand>`: each subcommand lives in its own module, listed in `SUBCOMMANDS`,
which exposes ``register(subparsers)``: it adds its parser and sets ``run=<fn(args) -> int>``
as the parser's default. Adding a subcommand is one line in `SUBCOMMANDS`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: tuple[str, ...] = (
    "headmoe.cli.generate",
    "headmoe.cli.plan",
    "headmoe.cli.compare",
    "headmoe.cli.serve",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of `SUBCOMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="headmoe",
        description="Run MAGI-2-family multi-head-MoE diffusion transformers across ranks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 on success)."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
