"""JSON messages between ranks, carried as uint8 tensors over the default group.

Only JSON crosses ranks: the payload is ``json.dumps(obj).encode()`` broadcast as a uint8
tensor after its length (an int64 tensor ``[1]``), so nothing is ever unpickled. Every call
is a collective of the whole world (every rank calls it in the same order) and is bounded by
the process group's timeout. In a world of one rank (no default group) they return their
input unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_json(obj: Any, src: int = 0, device: torch.device | None = None) -> Any:
    """``obj`` (JSON-able, significant on rank ``src`` only) on every rank; the tensors
    live on ``device`` (the rank's: CUDA under NCCL, default CPU)."""
    if not _distributed():
        return obj
    device = device or torch.device("cpu")
    mine = dist.get_rank() == src
    data = json.dumps(obj).encode() if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if mine
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src)
    return obj if mine else json.loads(buf.cpu().numpy().tobytes().decode())


def broadcast_flag(flag: bool, src: int = 0, device: torch.device | None = None) -> bool:
    """Rank ``src``'s ``flag`` on every rank (one int64 broadcast)."""
    if not _distributed():
        return flag
    t = torch.tensor([int(bool(flag))], dtype=torch.int64, device=device)
    dist.broadcast(t, src)
    return bool(t.item())


def all_gather_json(obj: Any, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank."""
    if not _distributed():
        return [obj]
    device = device or torch.device("cpu")
    world = dist.get_world_size()
    data = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, mine.to(device))
    return [json.loads(b[:n].cpu().numpy().tobytes().decode()) for b, n in zip(bufs, lengths)]
