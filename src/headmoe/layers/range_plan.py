"""The plan of a block-sparse attention call: query tiles and the key ranges of each
(`headmoe.layers.range_attention` states the function; its CPU and Triton paths both take
a `RangePlan`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RangePlan:
    """q_tiles `[R, 2]` int64 query rows [start, end); k_offsets `[R + 1]` int64: tile r
    attends to key ranges `k_ranges[k_offsets[r]:k_offsets[r + 1]]`; k_ranges `[K, 2]`
    int64 key rows [start, end). Host tensors; `device_copy` caches device copies."""

    q_tiles: torch.Tensor
    k_offsets: torch.Tensor
    k_ranges: torch.Tensor
    num_tokens: int

    def validate(self) -> None:
        """Raise `ValueError` when the tiles do not cover [0, num_tokens) exactly once or a
        key range is empty or out of bounds."""
        n = self.num_tokens
        order = torch.argsort(self.q_tiles[:, 0])
        tiles = self.q_tiles[order]
        ends = torch.cat([torch.zeros(1, dtype=torch.int64), tiles[:, 1]])
        if len(tiles) and (tiles[0, 0] != 0 or ends[-1] != n or bool((tiles[:, 0] != ends[:-1]).any())
                           or bool((tiles[:, 1] <= tiles[:, 0]).any())):
            raise ValueError(f"RangePlan.q_tiles must cover [0, {n}) once with non-empty tiles")
        k = self.k_ranges
        if len(k) and (bool((k[:, 0] < 0).any()) or bool((k[:, 1] > n).any())
                       or bool((k[:, 1] <= k[:, 0]).any())):
            raise ValueError(f"RangePlan.k_ranges must be non-empty ranges inside [0, {n})")
        off = self.k_offsets
        if off.numel() != len(self.q_tiles) + 1 or off[0] != 0 or off[-1] != len(k) or \
                bool((off[1:] <= off[:-1]).any()):
            raise ValueError("RangePlan.k_offsets must rise strictly from 0 to len(k_ranges)")

    def keys_of(self, tile: int) -> list[tuple[int, int]]:
        """The key ranges of one tile (host ints)."""
        a, b = int(self.k_offsets[tile]), int(self.k_offsets[tile + 1])
        return [tuple(r) for r in self.k_ranges[a:b].tolist()]

    def pairs(self) -> int:
        """Attended (query, key) pairs per head."""
        q = (self.q_tiles[:, 1] - self.q_tiles[:, 0])
        k = self.k_ranges[:, 1] - self.k_ranges[:, 0]
        per_tile = torch.zeros(len(q), dtype=torch.int64).index_add_(
            0, torch.repeat_interleave(torch.arange(len(q)), self.k_offsets.diff()), k)
        return int((q * per_tile).sum())
