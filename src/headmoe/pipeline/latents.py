"""The video latent geometry of a request: the strides, the frame rules and latent shapes.

A latent frame after the first decodes to `TEMPORAL_STRIDE` frames (the first latent to one
frame), and a latent covers `SPATIAL_STRIDE` x `SPATIAL_STRIDE` pixels, so a clip has
``num_frames = 4k+1`` frames and sides that are multiples of 16. Every video decoder (the
release's and the stand-in), the refiner stage, admission and the planner take these rules
from here; the latent space's statistics are the release's
(`headmoe.release.video_latents`).
"""

from __future__ import annotations

from headmoe.config import is_int

#: output frames per latent frame after the first, and pixels per latent side
TEMPORAL_STRIDE, SPATIAL_STRIDE = 4, 16


def check_side(name: str, value: int) -> int:
    """``value`` if it is a positive multiple of 16 (a latent is 16x16 pixels), else a
    `ValueError` whose message starts with ``name=value``."""
    if not is_int(value) or value < SPATIAL_STRIDE or value % SPATIAL_STRIDE:
        near = max(SPATIAL_STRIDE, round(value / SPATIAL_STRIDE) * SPATIAL_STRIDE) \
            if is_int(value) else SPATIAL_STRIDE
        raise ValueError(f"{name}={value!r} must be a positive multiple of {SPATIAL_STRIDE}, "
                         f"e.g. {near}")
    return value


def check_frames(num_frames: int) -> int:
    """``num_frames`` if it is ``4k+1`` (the decoders make the first frame, then 4 per
    latent), else a `ValueError` whose message starts with ``num_frames=value``."""
    if is_int(num_frames) and num_frames >= 1 and (num_frames - 1) % TEMPORAL_STRIDE == 0:
        return num_frames
    if not is_int(num_frames) or num_frames < 1:
        near = [1]
    else:
        low = (num_frames - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1
        near = [low, low + TEMPORAL_STRIDE]
    raise ValueError(f"num_frames={num_frames!r} must be of the form 4k+1 (the video "
                     f"decoders make 1 + 4k frames), use {' or '.join(map(str, near))}")


def latent_shape(num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """``(T_lat, H_lat, W_lat)`` for the video decoders (the release's and the stand-in):
    ``T_lat`` latent frames give ``4 T_lat - 3`` frames, so ``num_frames`` must be ``4k+1``
    (`check_frames`), and each latent is 16x16 pixels (`check_side`)."""
    check_side("height", height)
    check_side("width", width)
    check_frames(num_frames)
    return ((num_frames - 1) // TEMPORAL_STRIDE + 1, height // SPATIAL_STRIDE,
            width // SPATIAL_STRIDE)


def frame_count(latent_frames: int) -> int:
    """Frames decoded from ``latent_frames`` latents: ``4 (T - 1) + 1``."""
    return TEMPORAL_STRIDE * (latent_frames - 1) + 1
