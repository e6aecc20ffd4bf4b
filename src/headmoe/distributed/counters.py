"""Runtime counters: MoE rows computed and bytes moved by exchanges, per rank.

A `Counters` object lives on the `ParallelContext` (`ctx.counters`); exchanges and MoE
layers record into it when given one. Definitions (the planner predicts exactly these):

- MoE rows: per MoE layer call, the (token, head) rows this rank computed experts for,
  counting real heads only (padded zero heads are skipped, so they do not count).
- Exchange bytes: per collective, bytes this rank sends to / receives from *other* ranks
  (the block a rank keeps for itself does not cross a link and is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExchangeRecord:
    """One collective: its kind ("moe_scatter", "moe_gather", "ulysses_in", ...), and the
    bytes sent to and received from other ranks."""

    kind: str
    bytes_sent: int
    bytes_received: int


@dataclass
class Counters:
    """Per-rank event counters. Cheap: plain Python integers appended on the host."""

    moe_rows: list[int] = field(default_factory=list)
    """Rows computed per MoE layer call, in call order."""

    exchanges: list[ExchangeRecord] = field(default_factory=list)
    """Every recorded collective, in call order."""

    streamed_bytes: list[int] = field(default_factory=list)
    """Weight bytes moved to the device per streamed layer run (`--offload-layers`)."""

    def record_stream(self, nbytes: int) -> None:
        self.streamed_bytes.append(int(nbytes))

    def record_moe_rows(self, rows: int) -> None:
        self.moe_rows.append(int(rows))

    def record_exchange(self, kind: str, bytes_sent: int, bytes_received: int) -> None:
        self.exchanges.append(ExchangeRecord(str(kind), int(bytes_sent), int(bytes_received)))

    def reset(self) -> None:
        self.moe_rows.clear()
        self.exchanges.clear()
        self.streamed_bytes.clear()

    def summary(self) -> dict[str, object]:
        """JSON-ready totals: MoE calls, rows (total and max per call), and bytes per
        exchange kind."""
        kinds: dict[str, dict[str, int]] = {}
        for rec in self.exchanges:
            k = kinds.setdefault(rec.kind, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
            k["calls"] += 1
            k["bytes_sent"] += rec.bytes_sent
            k["bytes_received"] += rec.bytes_received
        return {
            "moe_calls": len(self.moe_rows),
            "moe_rows_total": sum(self.moe_rows),
            "moe_rows_max_per_call": max(self.moe_rows, default=0),
            "exchanges": kinds,
            "streamed_layers": len(self.streamed_bytes),
            "streamed_bytes": sum(self.streamed_bytes),
        }
