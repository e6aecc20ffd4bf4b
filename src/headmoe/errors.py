"""Exception types that say which kind of failure a message is (see `headmoe.cli.errors`):
`UserError` for refused input (exit 2), `RuntimeFault` for a run that failed (exit 1)."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input found before anything ran; the message names the flag/file/value and
    ends with what to do."""


class RuntimeFault(RuntimeError):
    """The run failed after it started (exit 1); the message names where and what to do."""


class NonFiniteError(RuntimeFault):
    """A NaN or Inf appeared in a prediction, a layer's output or the decoded media."""


class RankUnresponsive(RuntimeFault):
    """A rank stopped responding (it did not reach a step, or its heartbeat stopped)."""
