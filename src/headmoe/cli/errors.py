"""The one error boundary of the `headmoe` command line.

Every failure a user can cause ends in one line on stderr,

    headmoe: error: <what>, <which file/field/value>, <what to do>

and exit code `BAD_INPUT` (2: a flag, file or value was refused, nothing ran) or `FAULT`
(1: the run itself failed: a rank died or hung, a non-finite value, a write error). With
``--debug`` the traceback is printed first. `run_guarded` is the boundary; the exception
types below let code say which kind of failure it raises (any `ValueError` counts as bad
input, `RuntimeFault`/`OSError`/`LaunchFailure` as a fault).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from headmoe.cli.flags import refusal_text
from headmoe.errors import Refusal, RuntimeFault, UserError

BAD_INPUT, FAULT, INTERRUPTED = 2, 1, 130
__all__ = ["BAD_INPUT", "FAULT", "INTERRUPTED", "RuntimeFault", "UserError", "run_guarded"]


def one_line(text: str) -> str:
    """``text`` with its lines joined by "; " (the message of a one-line error)."""
    parts = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return "; ".join(parts) or "unknown error"


#: exception types whose name adds nothing to a rank's one-line summary
_PLAIN = ("UserError", "RuntimeFault", "NonFiniteError", "RankUnresponsive", "ValueError")


def _launch_message(exc: BaseException) -> tuple[int, str]:
    from headmoe.distributed.launch import failure_order

    summaries = getattr(exc, "summaries", None) or getattr(exc, "failures", {})
    ranks = failure_order(summaries, getattr(exc, "times", None))  # the root cause first
    first = ranks[0]
    text = one_line(summaries[first])
    kind, _, rest = text.partition(": ")
    code = BAD_INPUT if kind in ("UserError", "ValueError") else FAULT
    if kind in _PLAIN and rest:
        text = rest
    more = f" ({len(ranks) - 1} more rank(s) failed too)" if len(ranks) > 1 else ""
    return code, (f"rank {first} failed: {text}{more}, rerun with --debug for every rank's "
                  "traceback")


def describe(exc: BaseException, command: str) -> tuple[int, str]:
    """(exit code, one-line message without the ``headmoe: error:`` prefix) of ``exc``."""
    from headmoe.distributed.launch import LaunchFailure

    if isinstance(exc, LaunchFailure):
        return _launch_message(exc)
    if isinstance(exc, RuntimeFault):
        return FAULT, one_line(exc)
    if isinstance(exc, Refusal):  # a request field: its name shown as the flag that sets it
        message = refusal_text(exc.field, one_line(exc.message))
        return BAD_INPUT, f"{message}, see 'headmoe {command} --help'"
    if isinstance(exc, UserError):
        return BAD_INPUT, one_line(exc)
    if isinstance(exc, ValueError):  # flag validation: the message names the flag
        return BAD_INPUT, f"{one_line(exc)}, see 'headmoe {command} --help'"
    if isinstance(exc, OSError):
        where = exc.filename or "?"
        return FAULT, (f"{exc.strerror or one_line(exc)}, file {where!r}, check the path and "
                       "its permissions")
    if isinstance(exc, MemoryError):
        return FAULT, ("out of memory, the request does not fit this machine, use a smaller "
                       "request or more ranks")
    return FAULT, (f"internal error {type(exc).__name__}: {one_line(exc)}, rerun with --debug "
                   "and report the traceback")


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the exit flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread so that every ``finally`` and
    `headmoe.files.atomic_write` clean up (no ``.tmp`` file or folder stays); exit 143."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def run_guarded(fn: Callable[[], int], command: str, debug: bool) -> int:
    """Run ``fn`` inside the boundary; return its exit code or the failure's. SIGTERM
    becomes `Terminated` meanwhile (a subcommand may install its own handler, as serve's
    drain does)."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminate) if main else None
    try:
        return _guarded(fn, command, debug)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _guarded(fn: Callable[[], int], command: str, debug: bool) -> int:
    try:
        code = int(fn())
        sys.stdout.flush()
        return code
    except Terminated:
        if debug:
            traceback.print_exc()
        print("headmoe: terminated (SIGTERM), partial files removed", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        _quiet_stdout()  # `headmoe ... | head -1`: the reader left; not an error
        return 0
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("headmoe: interrupted", file=sys.stderr)
        return INTERRUPTED
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - this is the boundary
        code, message = describe(exc, command)
        if debug:
            traceback.print_exc()
            failures = getattr(exc, "failures", None)
            for rank, text in sorted((failures or {}).items()):
                print(f"--- rank {rank} ---\n{text}", file=sys.stderr)
        print(f"headmoe: error: {message}", file=sys.stderr)
        return code
