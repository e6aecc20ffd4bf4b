"""The token counts of one request, from its media shape.

A request is one packed sequence per CFG branch, `[video | audio | text]`; the branches
(conditional, unconditional) differ only in their text length. Frame and latent arithmetic
is the release decoders' (`headmoe.pipeline.latents.latent_shape`, MAGI2.md section
3): `T` latent frames decode to `4 (T - 1) + 1` output frames (the smallest `T` covering
`num_frames`) and 16x16 pixels each. MAGI-2 Preview: 125 frames at 12.5 fps = 10 s, so
272p (448 x 256) gives a `(32, 16, 28)` latent grid, 14,336 video tokens; audio uses 25
latent tokens per second of clip (250 for 10 s).
"""

from __future__ import annotations

from dataclasses import dataclass

from headmoe.config import check_positive_int, is_int, is_number
from headmoe.pipeline.latents import latent_shape
from headmoe.release.audio_vae import audio_latent_length


@dataclass(frozen=True)
class RequestShape:
    """Per-branch token counts: `video_latent` (T, H, W) grid, `audio_tokens`, and the text
    tokens of the conditional and unconditional branch (`text_tokens`, in branch order).
    Validated on construction (`ValueError` naming the field)."""

    video_latent: tuple[int, int, int]
    audio_tokens: int
    text_tokens: tuple[int, int]
    image_tokens: int = 0
    """Image-to-video: the rows the reference image adds to each branch (special token and
    latent grid, `headmoe.models.magi2.packing.image_rows`); 0 for text-to-video."""

    def __post_init__(self) -> None:
        for name, values, n in (("video_latent", self.video_latent, 3),
                                ("text_tokens", self.text_tokens, 2)):
            if not isinstance(values, tuple) or len(values) != n:
                raise ValueError(f"{name} must be a tuple of ints, got {values!r}")
            for v in values:
                if not is_int(v) or v < 0:
                    raise ValueError(f"{name} must hold non-negative ints, got {values!r}")
        for name in ("audio_tokens", "image_tokens"):
            a = getattr(self, name)
            if not is_int(a) or a < 0:
                raise ValueError(f"{name} must be a non-negative int, got {a!r}")
        if self.branch_tokens(0) == 0 or self.branch_tokens(1) == 0:
            raise ValueError(f"every branch needs at least one token, got {self!r}")

    @classmethod
    def from_media(
        cls, *, height: int, width: int, num_frames: int, fps: float, text_tokens: int,
        uncond_text_tokens: int,
    ) -> RequestShape:
        """Token counts of a `num_frames`-frame `height` x `width` clip at `fps` (see the
        module docstring). Raises `ValueError` naming the argument and value."""
        if not is_number(fps) or not fps > 0:
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        for name, value in (("height", height), ("width", width), ("num_frames", num_frames)):
            check_positive_int(name, value)
        latent = latent_shape(num_frames, height, width)
        audio = audio_latent_length(num_frames / fps)
        return cls(latent, audio, (text_tokens, uncond_text_tokens))

    @property
    def video_tokens(self) -> int:
        t, h, w = self.video_latent
        return t * h * w

    def branch_tokens(self, branch: int) -> int:
        """Tokens of branch 0 (conditional) or 1 (unconditional)."""
        return (self.video_tokens + self.audio_tokens + self.text_tokens[branch]
                + self.image_tokens)

    def to_dict(self) -> dict[str, object]:
        return {"video_latent": list(self.video_latent), "video_tokens": self.video_tokens,
                "audio_tokens": self.audio_tokens, "text_tokens": list(self.text_tokens),
                "image_tokens": self.image_tokens}
