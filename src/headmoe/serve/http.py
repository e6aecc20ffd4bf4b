"""The HTTP connection limits of ``headmoe serve`` (uvicorn's h11 protocol, bounded).

Connections are taken in three tiers, counted per client address (the peer's IP) and in
all, so that no client can lock the others out:

- **served**: at most `MAX_CONNECTIONS` in all and `CLIENT_SHARE` per client address;
- **limited**: past either, `LIMITED_CONNECTIONS` more in all (`LIMITED_PER_CLIENT` per
  client address) that answer ``/health`` and ``/metrics`` (`ANSWERED_PAST_CAP`) and give
  every other request the 429 error (``Retry-After``), then close;
- **refused**: past those, the connection gets the 429 error at once and is closed (no
  file descriptor is held).

A connection must deliver a complete request head within `HEADER_TIMEOUT_S` of opening, or
of its previous response; past `HIGH_WATER` connections (and for limited ones) within
`BUSY_HEADER_TIMEOUT_S`, and a new connection then closes the idle ones waiting longer
than that. The body has `BODY_TIMEOUT_S` (HTTP 408, `headmoe.serve.app`). Every 429 of
these limits is counted in `REFUSED` (``headmoe_connections_refused_total`` in
``/metrics``, `headmoe.serve.metrics.ServerMetrics`).

`LogBudget`: at most `LOG_BURST` log records per `LOG_WINDOW_S` seconds from the HTTP
server's and asyncio's loggers, then one line saying how many were dropped, so that a flood
of bad requests cannot fill the disk with stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: open HTTP connections served in full, in all
MAX_CONNECTIONS = 64
#: of them, per client address
CLIENT_SHARE = 16
#: connections past those answering /health and /metrics only, in all and per address
LIMITED_CONNECTIONS, LIMITED_PER_CLIENT = 16, 4
#: the paths a limited connection answers
ANSWERED_PAST_CAP = ("/health", "/metrics")
#: past this many connections the head deadline is `BUSY_HEADER_TIMEOUT_S`
HIGH_WATER = 48
#: seconds a connection has to send a complete request head (and when busy)
HEADER_TIMEOUT_S, BUSY_HEADER_TIMEOUT_S = 10.0, 2.0
#: seconds a request has to send its whole body
BODY_TIMEOUT_S = 30.0
#: the ``Retry-After`` (seconds) of a connection refused with 429
RETRY_AFTER_S = 1
#: log records passed per window, and the window (seconds)
LOG_BURST, LOG_WINDOW_S = 20, 60.0
#: the loggers `LogBudget` bounds
BOUNDED_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")
#: connections and requests refused by these limits, by reason (this process)
REFUSED: Counter[str] = Counter()
#: the ``type`` of the error shape of each status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 408: "invalid_request_error", 409: "conflict_error",
               410: "not_found_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "unavailable_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The one error shape ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": status}}


def _busy_message(why: str) -> bytes:
    return json.dumps(error_body(429, f"too many connections ({why}); retry in "
                                      f"{RETRY_AFTER_S} s")).encode()


def _busy_response(why: str) -> bytes:
    body = _busy_message(why)
    return (f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
            "connection: close\r\n\r\n").encode() + body


def _limited_app(app: Any, why: str) -> Any:
    """``app`` for the paths of `ANSWERED_PAST_CAP`; the 429 error (then close) otherwise."""

    async def limited(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in ANSWERED_PAST_CAP:
            return await app(scope, receive, send)
        REFUSED[why] += 1
        body = _busy_message(why)
        await send({"type": "http.response.start", "status": 429, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"retry-after", b"%d" % RETRY_AFTER_S), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return limited


def _is_limited(conn: BoundedH11) -> bool:
    return conn.limited is not None and conn.limited != "refused"


def _tier(conn: BoundedH11) -> str | None:
    """None (served), or why ``conn`` is limited (``"limited: ..."``) or refused."""
    host = conn.client[0] if conn.client else None
    others = [c for c in conn.connections if c is not conn and isinstance(c, BoundedH11)]
    mine = [c for c in others if c.client and c.client[0] == host]
    if (sum(c.limited is None for c in others) < MAX_CONNECTIONS
            and sum(c.limited is None for c in mine) < CLIENT_SHARE):
        return None
    if (sum(_is_limited(c) for c in others) < LIMITED_CONNECTIONS
            and sum(_is_limited(c) for c in mine) < LIMITED_PER_CLIENT):
        full = "this address's share" if len(mine) >= CLIENT_SHARE else "the server's cap"
        return f"limited: past {full}"
    return "refused"


class BoundedH11(H11Protocol):
    """`H11Protocol` with the tiers and head deadlines of the module docstring."""

    _head_timer: asyncio.TimerHandle | None = None
    limited: str | None = None
    _idle_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > HIGH_WATER:
            self._close_idle()
        tier = _tier(self)
        if tier == "refused":
            REFUSED["refused"] += 1
            self.limited = tier
            transport.write(_busy_response("every connection slot is taken"))
            transport.close()  # the 429 is flushed, then the descriptor freed
            return
        if tier is not None:
            self.limited, self.app = tier, _limited_app(self.app, tier)
        self._arm()

    def _close_idle(self) -> None:
        """Close the connections waiting for a head longer than `BUSY_HEADER_TIMEOUT_S`."""
        now = self.loop.time()
        for c in list(self.connections):
            if (isinstance(c, BoundedH11) and c is not self and c._waiting_for_head()
                    and now - c._idle_since > min(BUSY_HEADER_TIMEOUT_S, HEADER_TIMEOUT_S)
                    and not c.transport.is_closing()):
                c.transport.abort()

    def _deadline(self) -> float:
        busy = self.limited is not None or len(self.connections) > HIGH_WATER
        return min(BUSY_HEADER_TIMEOUT_S, HEADER_TIMEOUT_S) if busy else HEADER_TIMEOUT_S

    def _arm(self) -> None:
        self._disarm()
        self._idle_since = self.loop.time()
        self._head_timer = self.loop.call_later(self._deadline(), self._head_late)

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
    # no `limit_concurrency`: its plain-text 503 would answer before the tiers do; the
    # tiers bound the connections, and h11 runs one request per connection at a time
    return {"http": BoundedH11, "limit_concurrency": None,
            "timeout_keep_alive": int(HEADER_TIMEOUT_S)}
