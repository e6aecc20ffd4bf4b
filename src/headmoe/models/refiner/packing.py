"""Packing one refiner forward into one token sequence (REFINER.md section 4) and back.

One forward holds one request's video latent and one text (no CFG packing, no audio as
released). Packed order is upstream's: the video voxels walked in blocks of
`block_t x block_h x block_w` (block-major over (bt, bh, bw), row-major (t, h, w) inside a
block, far-edge blocks cut short), then the text rows in their own order. Packed row i
is raster row `token_order[i]` (raster: video (t, h, w) row-major, then text), as the
golden `packed.token_order`. Video block b = (bt * nbh + bh) * nbw + bw holds packed rows
`block_ranges[b]`; it sees block c iff `block_visible[b, c]`; text rows see, and are seen
by, every row (REFINER.md section 6).

| name | shape | dtype | meaning |
|---|---|---|---|
| x | [N, Cx] | fp32 | latent voxels / text features, zero-padded to Cx = max in-channels |
| coords | [N, 9] | fp32 | (t, h, w, T, H, W, rT, rH, rW) per row |
| modality | [N] | int64 | 0 video, 2 text |
| token_order | [N] | int64 | raster row of each packed row |
| block_ranges | [nb, 2] | int64 | packed rows [start, end) of each video block |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from headmoe.layers.range_plan import RangePlan
from headmoe.models.magi2.config import TEXT, VIDEO
from headmoe.models.magi2.packing import branch_coords
from headmoe.models.refiner.config import Magi2RefinerConfig


@dataclass(frozen=True)
class BlockGrid:
    """The video block structure of one forward (host ints and tensors).

    `thw`: latent frames, height, width; `grid`: blocks along t, h, w
    (ceil(T / bt), ...); `block`: block sizes; `radius`: visibility radii in blocks."""

    thw: tuple[int, int, int]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    radius: tuple[int, int, int]

    @classmethod
    def of(cls, thw: tuple[int, int, int], config: Magi2RefinerConfig) -> BlockGrid:
        grid = cast(tuple[int, int, int], tuple(-(-n // b) for n, b in zip(thw, config.block_size)))
        return cls(cast(tuple[int, int, int], tuple(thw)), grid, config.block_size, config.radius)

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def num_video(self) -> int:
        return self.thw[0] * self.thw[1] * self.thw[2]

    def raster_block_ids(self) -> torch.Tensor:
        """`[Nv]` int64: the block of each raster video voxel."""
        t, h, w = (torch.arange(n) // b for n, b in zip(self.thw, self.block))
        _, gh, gw = self.grid
        return ((t[:, None, None] * gh + h[None, :, None]) * gw + w[None, None, :]).reshape(-1)

    def token_order(self) -> torch.Tensor:
        """`[Nv]` int64: packed video row i is raster voxel `order[i]` (block-major, then
        (t, h, w) row-major inside the block)."""
        return torch.sort(self.raster_block_ids(), stable=True).indices

    def block_counts(self) -> torch.Tensor:
        """`[nb]` int64 voxels per block."""
        return torch.bincount(self.raster_block_ids(), minlength=self.num_blocks)

    def block_ranges(self) -> torch.Tensor:
        """`[nb, 2]` int64 packed rows [start, end) of each block."""
        end = torch.cumsum(self.block_counts(), 0)
        return torch.stack([end - self.block_counts(), end], dim=1)

    def block_coords(self) -> torch.Tensor:
        """`[nb, 3]` int64 (bt, bh, bw) of each block."""
        gt, gh, gw = self.grid
        b = torch.arange(self.num_blocks)
        return torch.stack([b // (gh * gw), (b // gw) % gh, b % gw], dim=1)

    def block_visible(self) -> torch.Tensor:
        """`[nb, nb]` bool: query block i may attend to key block j (tiny grids only; the
        attention never builds it: see `key_runs`)."""
        c = self.block_coords()
        d = (c[:, None, :] - c[None, :, :]).abs()
        return (d <= torch.tensor(self.radius)).all(-1)

    def key_runs(self, block: int) -> list[tuple[int, int]]:
        """The visible key blocks of query `block` as runs of consecutive block ids
        `[first, last + 1)`, ascending: one run per visible (bt, bh) row of blocks."""
        gt, gh, gw = self.grid
        bt, bh, bw = block // (gh * gw), (block // gw) % gh, block % gw
        rt, rh, rw = self.radius
        lo_w, hi_w = max(0, bw - rw), min(gw, bw + rw + 1)
        return [((t * gh + h) * gw + lo_w, (t * gh + h) * gw + hi_w)
                for t in range(max(0, bt - rt), min(gt, bt + rt + 1))
                for h in range(max(0, bh - rh), min(gh, bh + rh + 1))]


@dataclass(frozen=True)
class RefinerPacked:
    """One packed refiner forward (module table); `grid` its video blocks; rows
    `[0, grid.num_video)` are video, the rest text."""

    x: torch.Tensor
    coords: torch.Tensor
    modality: torch.Tensor
    token_order: torch.Tensor
    block_ranges: torch.Tensor
    grid: BlockGrid

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def num_video(self) -> int:
        return self.grid.num_video


def _check_inputs(video: torch.Tensor, text: torch.Tensor, config: Magi2RefinerConfig) -> None:
    for name, x, dims, ch in (("video", video, 4, config.video_in_channels),
                              ("text", text, 2, config.text_in_channels)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims or x.dtype != torch.float32 or \
                x.shape[0 if name == "video" else 1] != ch:
            got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
            want = "[C, T, H, W]" if name == "video" else "[L, C]"
            raise ValueError(f"refiner {name} must be an fp32 {want} tensor with C={ch}, "
                             f"got {got}")
    if video.shape[1:].numel() == 0:
        raise ValueError(f"refiner video must hold at least one voxel, got {tuple(video.shape)}")


def pack_refiner(
    video: torch.Tensor, text: torch.Tensor, config: Magi2RefinerConfig
) -> RefinerPacked:
    """Pack one forward: video latent `[C_v, T, H, W]` fp32 and text features `[Lt, C_t]`
    fp32 (Lt may be 0). Raises `ValueError` naming the bad input. Outputs on the host."""
    _check_inputs(video, text, config)
    c, t, h, w = video.shape
    grid = BlockGrid.of((t, h, w), config)
    lt = text.shape[0]
    width = config.max_in_channels
    order = grid.token_order()
    raster = video.detach().cpu().reshape(c, -1).t()
    x = torch.zeros(len(order) + lt, width)
    x[: len(order), :c] = raster[order]
    x[len(order):, : text.shape[1]] = text.detach().cpu()
    coords = branch_coords(t, h, w, 0, lt)
    coords = torch.cat([coords[: len(order)][order], coords[len(order):]])
    modality = torch.full((len(order) + lt,), TEXT, dtype=torch.int64)
    modality[: len(order)] = VIDEO
    token_order = torch.cat([order, torch.arange(len(order), len(order) + lt)])
    return RefinerPacked(x, coords, modality, token_order, grid.block_ranges(), grid)


def unpack_video(out: torch.Tensor, packed: RefinerPacked, channels: int) -> torch.Tensor:
    """`[N, P]` packed output rows -> the video `[channels, T, H, W]` fp32 in raster order."""
    nv = packed.num_video
    raster = torch.empty((nv, channels), dtype=out.dtype, device=out.device)
    raster[packed.token_order[:nv].to(out.device)] = out[:nv, :channels]
    return raster.t().reshape(channels, *packed.grid.thw).contiguous()


#: rows of one query tile of the tail (text) rows: the video block volume of the release
TAIL_TILE_ROWS = 128


def attention_plan(packed: RefinerPacked, tail_tile_rows: int = TAIL_TILE_ROWS) -> RangePlan:
    """The block-grid mask of one forward as a `RangePlan`, without a dense mask: one query
    tile per video block, whose keys are the runs of its visible blocks (ascending) and
    then the tail rows [Nv, N); the tail rows in tiles of `tail_tile_rows`, whose keys are
    every row [0, N)."""
    grid, n, nv = packed.grid, packed.num_tokens, packed.num_video
    ranges = packed.block_ranges.tolist()
    tiles: list[tuple[int, int]] = []
    keys: list[tuple[int, int]] = []
    offsets = [0]
    for b, (a, e) in enumerate(ranges):
        if e == a:
            continue
        tiles.append((a, e))
        keys.extend((ranges[lo][0], ranges[hi - 1][1]) for lo, hi in grid.key_runs(b))
        if n > nv:
            keys.append((nv, n))
        offsets.append(len(keys))
    for a in range(nv, n, tail_tile_rows):
        tiles.append((a, min(a + tail_tile_rows, n)))
        keys.append((0, n))
        offsets.append(len(keys))
    return RangePlan(_pairs(tiles), torch.tensor(offsets, dtype=torch.int64), _pairs(keys), n)


def _pairs(rows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
