"""`headmoe <subcommand>`: each subcommand lives in its own module, listed in `SUBCOMMANDS`,
which exposes ``register(subparsers)``: it adds its parser and sets ``run=<fn(args) -> int>``
as the parser's default. Adding a subcommand is one line in `SUBCOMMANDS`."""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Sequence

from headmoe import __version__

SUBCOMMANDS: tuple[str, ...] = (
    "headmoe.cli.generate",
    "headmoe.cli.plan",
    "headmoe.cli.compare",
    "headmoe.cli.serve",
    "headmoe.cli.quantize",
)


class Parser(argparse.ArgumentParser):
    """Flag errors as one ``headmoe: error: ...`` line (exit 2), like every other error,
    with "did you mean" for a misspelt flag or subcommand. No prefix matching, in any
    subcommand (they are built with this class): ``serve --offload`` is refused, not read
    as ``--offload-layers``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"headmoe: error: {message}{_suggestion(self, message)}, see '{self.prog} "
              "--help'", file=sys.stderr)
        sys.exit(2)


def _known(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.Action], list[str]]:
    """(every flag of ``parser`` and its subcommands -> its action, the subcommand names)."""
    flags, commands = dict(parser._option_string_actions), []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands = list(action.choices)
            for sub in action.choices.values():
                flags.update(sub._option_string_actions)
    return flags, commands


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``" (did you mean --prompt?)"`` for an unknown flag or subcommand close to a known
    one, else ""."""
    flags, commands = _known(parser)
    if m := re.search(r"invalid choice: '([^']*)'", message):
        words, known = [m.group(1)], commands
    elif message.startswith("unrecognized arguments: "):
        words = [w.split("=")[0] for w in message.split(": ", 1)[1].split() if w.startswith("-")]
        known = flags
    else:
        return ""
    bare = {k.lstrip("-"): k for k in list(known)}  # "--" alone would make anything look close
    hits = [bare[h] for w in words
            for h in difflib.get_close_matches(w.lstrip("-"), list(bare), n=1, cutoff=0.75)]
    return f" (did you mean {' / '.join(dict.fromkeys(hits))}?)" if hits else ""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of `SUBCOMMANDS` registered."""
    parser = Parser(
        prog="headmoe",
        description="Run MAGI-2-family multi-head-MoE diffusion transformers across ranks.",
    )
    debug_help = "print the traceback of a failure (and check every layer for NaN/Inf)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    parser.add_argument("--version", action="version", version=f"headmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    for name, subparser in sub.choices.items():
        if name != "help":
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                   help=debug_help)
    return parser


def _refuse_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An unknown ``--flag`` is refused first (with "did you mean"), before argparse can
    report a missing required flag instead: ``--promt x`` names ``--prompt``."""
    flags, _ = _known(parser)
    unknown, value_next = [], False
    for token in argv:
        if value_next:  # the value of the flag before it, whatever it looks like
            value_next = False
            continue
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not name.startswith("--") or any(c.isspace() for c in token):
            continue
        action = flags.get(name)
        if action is None:
            unknown.append(token)
        value_next = "=" not in token and action is not None and action.nargs != 0
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 on success). Failures end in one
    ``headmoe: error: ...`` line (`headmoe.cli.errors`)."""
    from headmoe.cli.errors import run_guarded

    parser = build_parser()
    _refuse_unknown_flags(parser, sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    from headmoe import check_torch
    from headmoe.numerics import require_reproducible_blas

    def run() -> int:
        check_torch()
        require_reproducible_blas()
        return args.run(args)

    return run_guarded(run, args.command, args.debug)


if __name__ == "__main__":
    sys.exit(main())
