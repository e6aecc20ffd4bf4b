"""The HTTP connection limits of ``headmoe serve`` (uvicorn's h11 protocol, bounded).

- `MAX_CONNECTIONS` open connections at most: a connection beyond them is closed at once,
  so half-sent requests cannot exhaust the server's file descriptors.
- `HEADER_TIMEOUT_S`: a connection must deliver a complete request head (request line and
  headers) within this many seconds of opening, or of its previous response; else it is
  closed. The body has `BODY_TIMEOUT_S` (HTTP 408, `headmoe.serve.app`).
- `LogBudget`: at most `LOG_BURST` log records per `LOG_WINDOW_S` seconds from the HTTP
  server's and asyncio's loggers, then one line saying how many were dropped, so that a
  flood of bad requests cannot fill the disk with stderr.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: open HTTP connections at most (each more is closed at once)
MAX_CONNECTIONS = 64
#: seconds a connection has to send a complete request head
HEADER_TIMEOUT_S = 10.0
#: seconds a request has to send its whole body
BODY_TIMEOUT_S = 30.0
#: log records passed per window, and the window (seconds)
LOG_BURST, LOG_WINDOW_S = 20, 60.0
#: the loggers `LogBudget` bounds
BOUNDED_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")


class BoundedH11(H11Protocol):
    """`H11Protocol` with `MAX_CONNECTIONS` and `HEADER_TIMEOUT_S` (module docstring)."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            transport.abort()  # frees the descriptor now; connection_lost tidies up
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _head_late(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm()  # the head arrived: the app bounds the body

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request head (keep-alive) has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class LogBudget(logging.Filter):
    """Pass at most `LOG_BURST` records per `LOG_WINDOW_S`; the first record of the next
    window says how many were dropped."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S):
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self.start, self.passed, self.dropped = time.monotonic(), 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.start >= self.window_s:
            if self.dropped:
                record.msg = f"({self.dropped} log lines dropped) {record.msg}"
            self.start, self.passed, self.dropped = now, 0, 0
        if self.passed >= self.burst:
            self.dropped += 1
            return False
        self.passed += 1
        return True


def bound_logs() -> LogBudget:
    """Install one `LogBudget` on every logger of `BOUNDED_LOGGERS` (once)."""
    budget = LogBudget()
    for name in BOUNDED_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, LogBudget)]:
            logger.removeFilter(old)
        logger.addFilter(budget)
    return budget


def uvicorn_options() -> dict[str, Any]:
    """The uvicorn `Config` options of these limits."""
    return {"http": BoundedH11, "limit_concurrency": MAX_CONNECTIONS,
            "timeout_keep_alive": int(HEADER_TIMEOUT_S)}
