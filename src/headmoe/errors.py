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


class Refusal(UserError):
    """A request refused by admission (`headmoe.pipeline.admission`): ``field`` is the
    request field (``"a,b"`` when two fields contradict each other), ``value`` the value
    given, ``message`` the one-line reason in field names (``num_frames=14 ...``). Every
    entry point reports the same refusal; the command line shows the fields as flags,
    the HTTP API returns ``field`` as the error's ``param``."""

    def __init__(self, field: str, value: object, message: str):
        super().__init__(message)
        self.field, self.value, self.message = field, value, message

    def __reduce__(self) -> tuple[type[Refusal], tuple[str, object, str]]:  # picklable (ranks, spawned processes)
        return (type(self), (self.field, self.value, self.message))
