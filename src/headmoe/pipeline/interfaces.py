"""What a job runs, as interfaces: the transformer (`Denoiser`), the text encoder, the video
and audio decoders, the image encoder, the refiner model and where its weights live
(`Refiner`), `Components`, which holds one of each, and `ReleaseFolder`, what the job
reads of the release folder its components come from.

The pipeline talks to its non-transformer components only through the protocols below, so
MAGI-2's real components (`headmoe.release`: a large text encoder with 5120-d features, the
video VAE and the audio VAE) and the tiny stand-ins (`headmoe.release.standins`) plug in by
implementing them; see docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from headmoe.models.magi2 import BranchInput
from headmoe.models.refiner import Magi2Refiner
from headmoe.pipeline.image import ReferenceImage


class TextEncoder(Protocol):
    """Text -> features. ``out_channels`` must equal the transformer's ``text_in_channels``."""

    out_channels: int

    def encode(self, text: str) -> torch.Tensor:
        """Features ``[L_text, out_channels]`` fp32 on CPU, ``L_text >= 1`` (also for "")."""
        ...


class FigureTextEncoder(TextEncoder, Protocol):
    """The text encoder of an image-to-video model: also finds the image marker."""

    def figure_indices(self, text: str) -> list[int]:
        """Token indices of the ``<Figure 1>`` marker in ``text`` as the encoder tokenizes
        it (`headmoe.pipeline.i2v.figure_token_indices`), the same on every rank."""
        ...


class VideoDecoder(Protocol):
    """Video latents -> uint8 RGB frames."""

    latent_channels: int

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(T_lat, H_lat, W_lat)`` of the latents that decode to at least ``num_frames``
        frames of ``height x width``; raises `ValueError` naming the argument if the size
        does not fit the decoder's strides."""
        ...

    def decode(self, latents: torch.Tensor, num_frames: int) -> torch.Tensor:
        """``[T_lat, H_lat, W_lat, latent_channels]`` fp32 -> ``[num_frames, H, W, 3]`` uint8."""
        ...


class AudioDecoder(Protocol):
    """Audio latents -> waveform."""

    latent_channels: int
    sample_rate: int
    channels: int

    def latent_length(self, duration_s: float) -> int:
        """``T_audio``: latent tokens that cover ``duration_s`` seconds."""
        ...

    def decode(self, latents: torch.Tensor, num_samples: int) -> torch.Tensor:
        """``[T_audio, latent_channels]`` fp32 -> ``[channels, num_samples]`` fp32 in [-1, 1]."""
        ...


class Denoiser(Protocol):
    """Velocity predictions ``[(v_video, v_audio)]`` (fp32, shaped like each branch's video
    and audio) for the branches this rank's SP group runs; identical on every rank of it."""

    def __call__(
        self, branches: Sequence[BranchInput]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class ImageEncoder(Protocol):
    """Image-to-video: a reference image -> its clean video latent."""

    def encode(self, image: ReferenceImage) -> torch.Tensor:
        """``[h, w, video latent channels]`` fp32 on CPU (``(h, w) = image.latent_size``),
        identical on every rank."""
        ...


class Refiner:
    """The refiner model of a job on one rank and where its weights live: on the device,
    or (``offload`` on a GPU) on the host except while `active` runs the stage, which moves
    the preview transformer (``idle``, None: nothing to move) to the host for that time."""

    def __init__(self, model: Magi2Refiner, idle: torch.nn.Module | None,
                 device: torch.device, offload: bool):
        self.model, self.idle, self.device = model, idle, device
        self.offload = offload and device.type != "cpu"

    @contextlib.contextmanager
    def active(self) -> Iterator[Magi2Refiner]:
        idle = self.idle if self.offload else None
        if self.offload:
            if idle is not None:
                idle.to("cpu")
            self.model.to(self.device)
        try:
            yield self.model
        finally:
            if self.offload:
                self.model.to("cpu")
                if idle is not None:
                    idle.to(self.device)


@dataclass
class Components:
    """What a job runs: the transformer behind `Denoiser`, the three codecs and, for
    image-to-video, the image encoder (None: the model takes no image)."""

    denoiser: Denoiser
    text_encoder: TextEncoder
    video_decoder: VideoDecoder
    audio_decoder: AudioDecoder
    image_encoder: ImageEncoder | None = None
    refiner: Refiner | None = None
    """The 1080p stage's `Refiner` (None: the job has no refiner)."""


class ReleaseFolder(Protocol):
    """A checked release folder as a job holds it (`headmoe.release.folder.Release`
    implements it): what the pipeline reads of it without importing the release layer."""

    @property
    def image_encoder(self) -> str | None:
        """The ``vae/`` folder of the I2V image encoder (None: no image input)."""

    @property
    def refiner(self) -> str | None:
        """The refiner checkpoint under ``refiner/`` (None: the folder has none)."""

    def describe(self) -> dict[str, object]:
        """What the sidecar records about the folder."""
