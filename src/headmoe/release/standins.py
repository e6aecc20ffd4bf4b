"""The tiny stand-ins for the release's text encoder and decoders (used when a job runs
without a release folder, e.g. ``--model tiny``). Deterministic weights drawn from fixed
seeds (no download, identical on every machine and rank); they implement the protocols of
`headmoe.pipeline.interfaces`:

- `ByteTextEncoder`: UTF-8 bytes plus a leading BOS token, looked up in an embedding table.
- `TinyVideoDecoder`: every latent token `[C]` maps linearly to a `4 x 16 x 16 x 3` block of
  pixels (temporal stride 4, spatial stride 16; the first latent frame yields one frame, as in
  causal video VAEs), then tanh -> uint8.
- `TinyAudioDecoder`: every latent token `[C]` (25 per second) maps linearly to 1764 mono
  samples at 44.1 kHz, then tanh.
"""

from __future__ import annotations

import math

import torch

from headmoe.pipeline.latents import SPATIAL_STRIDE, TEMPORAL_STRIDE, latent_shape
from headmoe.release.audio_vae import LATENT_FPS, OUTPUT_SAMPLE_RATE, audio_latent_length

TEXT_SEED, VIDEO_SEED, AUDIO_SEED = 1001, 1002, 1003


def _weights(seed: int, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32) / math.sqrt(fan_in)


class ByteTextEncoder:
    """Byte-level tokenizer (token 256 = BOS, then the UTF-8 bytes, at most ``max_tokens``
    in all, longer text is truncated) and an embedding table ``[257, out_channels]``
    ~ N(0, 1) from a fixed seed."""

    def __init__(self, out_channels: int, max_tokens: int = 256, seed: int = TEXT_SEED):
        self.out_channels, self.max_tokens = out_channels, max_tokens
        self.table = _weights(seed, (257, out_channels), 1)

    def tokenize(self, text: str) -> list[int]:
        """Token ids: BOS (256) then the UTF-8 bytes, truncated to ``max_tokens``."""
        return ([256] + list(text.encode("utf-8")))[: self.max_tokens]

    def token_count(self, text: str) -> int:
        """Tokens of ``text`` before truncation (BOS + its UTF-8 bytes)."""
        return 1 + len(text.encode("utf-8"))

    def encode(self, text: str) -> torch.Tensor:
        """``[L_text, out_channels]`` fp32, ``1 <= L_text <= max_tokens``."""
        return self.table[torch.tensor(self.tokenize(text))]


class TinyVideoDecoder:
    """Linear per-token decoder, temporal stride 4, spatial stride 16 (see module doc)."""

    t_stride, s_stride = TEMPORAL_STRIDE, SPATIAL_STRIDE

    def __init__(self, latent_channels: int, seed: int = VIDEO_SEED):
        self.latent_channels = latent_channels
        self.weight = _weights(
            seed,
            (latent_channels, self.t_stride * self.s_stride * self.s_stride * 3),
            latent_channels,
        )

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The decoders' one rule, `headmoe.pipeline.latents.latent_shape`."""
        return latent_shape(num_frames, height, width)

    def decode(self, latents: torch.Tensor, num_frames: int) -> torch.Tensor:
        t, h, w, _ = latents.shape
        st, ss = self.t_stride, self.s_stride
        px = torch.tanh(latents.reshape(-1, self.latent_channels) @ self.weight)
        px = px.reshape(t, h, w, st, ss, ss, 3).permute(0, 3, 1, 4, 2, 5, 6)
        frames = px.reshape(t * st, h * ss, w * ss, 3)[st - 1 :][:num_frames]
        return ((frames + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)


class TinyAudioDecoder:
    """Linear per-token decoder: 25 tokens per second, 1764 mono samples each at 44.1 kHz."""

    tokens_per_second, sample_rate, channels = LATENT_FPS, OUTPUT_SAMPLE_RATE, 1

    def __init__(self, latent_channels: int, seed: int = AUDIO_SEED):
        self.latent_channels = latent_channels
        self.hop = self.sample_rate // self.tokens_per_second
        self.weight = _weights(seed, (latent_channels, self.hop), latent_channels)

    def latent_length(self, duration_s: float) -> int:
        """The decoders' one rule, `audio_vae.audio_latent_length`."""
        return audio_latent_length(duration_s)

    def decode(self, latents: torch.Tensor, num_samples: int) -> torch.Tensor:
        wave = torch.tanh(latents @ self.weight).reshape(1, -1)
        return wave[:, :num_samples]
