"""3-D rotary position embedding from per-token (t, h, w) coordinates.

Each axis gets `bands` frequencies `theta^(-j / bands)`, j = 0..bands-1; the 3 * bands
angles (axis-major: t bands, h bands, w bands) rotate the first 6 * bands dims of a head
with the rotate-half convention (dim i pairs with dim i + 3 * bands); the remaining dims
pass through. Tables are computed in float64 on the host and rounded once to fp32, so a
token's angles depend only on its coordinates.
"""

from __future__ import annotations

import torch


def rope_tables(
    coords: torch.Tensor, bands: int, theta: float = 10000.0,
    axis_scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """coords `[T, 3]` float64 (t, h, w) -> (cos, sin), each fp32 `[T, 3 * bands]`."""
    freqs = theta ** (-torch.arange(bands, dtype=torch.float64) / bands)
    scaled = coords.double() * torch.tensor(axis_scales, dtype=torch.float64)
    angles = (scaled[:, :, None] * freqs).reshape(coords.shape[0], 3 * bands)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, H, D]` fp32, cos/sin `[T, R/2]` fp32 (R <= D rotated dims) -> `[T, H, D]` fp32."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
