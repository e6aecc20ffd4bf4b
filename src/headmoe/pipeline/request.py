"""One text-to-video+audio request (pure data, validated on construction)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from headmoe.pipeline.sampler import SAMPLERS

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: where the initial noise is drawn: "cpu" (every layout and device gives the same bytes)
#: or "cuda" (the reference's CUDA generator: values depend on the GPU model)
NOISE_DEVICES: tuple[str, ...] = ("cpu", "cuda")

#: headmoe's default negative prompt (our own wording, not the release's: MAGI-2 Preview
#: uses a fixed long negative prompt of its own for the unconditional branch)
DEFAULT_NEGATIVE_PROMPT = (
    "blurry, low quality, distorted, deformed, watermark, text, flicker, frozen frame, "
    "noisy audio"
)


@dataclass(frozen=True)
class GenerateRequest:
    """What to generate. Defaults are sized for the embedded tiny model on a CPU: 13 frames
    of 64 x 96 at 12.5 fps (1.04 s; 4 x 4 x 6 video latents and 26 audio latents)."""

    prompt: str
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    height: int = 64
    width: int = 96
    num_frames: int = 13
    fps: float = 12.5
    num_inference_steps: int = 8
    seed: int = 0
    guidance_scale: float = 5.0
    """Video guidance scale s in v = v_u + s (v_c - v_u)."""
    audio_guidance_scale: float = 7.0
    shift: float = 7.0
    """Flow-matching time shift."""
    sampler: str = "unipc"
    dtype: str = "fp32"
    """Dtype of the transformer's linears and experts ("fp32" or "bf16"); latents, sampler
    and decoders are always fp32."""
    noise_device: str = "cpu"
    """Generator of the initial noise (`NOISE_DEVICES`)."""

    def __post_init__(self) -> None:
        for name in ("prompt", "negative_prompt"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {getattr(self, name)!r}")
        for name in ("height", "width", "num_frames", "num_inference_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.seed >= 1 << 63:
            raise ValueError(f"seed must be below 2**63, got {self.seed!r}")
        for name in ("fps", "guidance_scale", "audio_guidance_scale", "shift"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("fps", "shift"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.noise_device not in NOISE_DEVICES:
            raise ValueError(
                f"noise_device must be one of {NOISE_DEVICES}, got {self.noise_device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")

    @property
    def duration_s(self) -> float:
        """num_frames / fps."""
        return self.num_frames / self.fps

    def audio_samples(self, sample_rate: int) -> int:
        """Audio samples of the clip at `sample_rate` Hz: `round(duration_s * sample_rate)`.
        Raises `ValueError` naming num_frames and fps when that is 0 (no audio track)."""
        n = round(self.duration_s * sample_rate)
        if n < 1:
            raise ValueError(
                f"num_frames={self.num_frames} at fps={self.fps!r} lasts {self.duration_s:.3g} s, "
                f"less than one audio sample at {sample_rate} Hz"
            )
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
