"""3-D rotary position embedding of MAGI-2 (MAGI2.md section 3.1).

Each token carries 9 coordinates (t, h, w, T, H, W, rT, rH, rW): its position, the size of
its grid and the reference size. Per axis a: scale_a = (ref_a - 1) / (size_a - 1) (1 where
ref_a = size_a = 1), centre_a = (size_a - 1) / 2 for h and w and 0 for t, and the angle of
band j is p[a, j] = (coord_a - centre_a) * scale_a * bands[j]. The table is
`[sin p | cos p]`, each flattened axis-major (t bands, h bands, w bands), all in fp32 (the
release's arithmetic: the golden `trace.rope` is reproduced bit for bit). The 3B angles
rotate the first 6B dims of a head, non-interleaved (dim i pairs with dim i + 3B); the rest
pass through. A row's table depends only on its own coordinates.
"""

from __future__ import annotations

import torch


def default_bands(bands: int, theta: float = 10000.0) -> torch.Tensor:
    """`[bands]` fp32: theta^(-j / bands) (the checkpoint's `pre_adapter.rope.bands`)."""
    return (theta ** (-torch.arange(bands, dtype=torch.float64) / bands)).float()


def rope_table(coords: torch.Tensor, bands: torch.Tensor) -> torch.Tensor:
    """coords `[T, 9]` fp32, bands `[B]` fp32 -> `[T, 6B]` fp32 `[sin p | cos p]`."""
    c = coords.float()
    pos, size, ref = c[:, 0:3], c[:, 3:6], c[:, 6:9]
    unit = (size == 1) & (ref == 1)
    scale = torch.where(unit, torch.ones_like(size), (ref - 1) / torch.where(unit, 1, size - 1))
    centre = torch.zeros_like(size)
    centre[:, 1:] = (size[:, 1:] - 1) / 2
    b = bands.float().to(c.device)
    p = (((pos - centre) * scale)[:, :, None] * b).reshape(len(c), 3 * b.numel())
    return torch.cat([p.sin(), p.cos()], dim=-1)


def split_table(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, 6B]` `[sin | cos]` -> (cos, sin), each `[T, 3B]` (contiguous)."""
    half = table.shape[1] // 2
    return table[:, half:].contiguous(), table[:, :half].contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, H, D]` fp32, cos/sin `[T, R/2]` fp32 (R <= D rotated dims) -> `[T, H, D]` fp32."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
