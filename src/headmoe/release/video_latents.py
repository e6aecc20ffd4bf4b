"""MAGI-2's video latent space: the 48-channel Wan2.2 statistics and the pixel conversion.

The latent geometry (strides, ``4k+1`` frames, sides of 16, latent shapes) is the
pipeline's, `headmoe.pipeline.latents`.

Both video decoders (TurboV3 and the full Wan2.2 VAE) read *de-normalised* latents,
``z * std + mean`` per channel, and produce pixels in about [-1, 1].

Source of the constants: the 48 float32 literals ``self.mean`` / ``self.std`` of
``Wan2_2_VAE.__init__`` (Wan-Video/Wan2.2 ``wan/modules/vae2_2.py``; identical in SandAI's
``inference/model/vae2_2.py`` and hard-coded again in its ``TurboVAED``), as recorded in
``shared/golden/{turbo_vae,wan22_vae}/case*.safetensors`` keys ``in.latent_mean`` /
``in.latent_std`` (a test checks bit equality). They are not read from any checkpoint.
"""

from __future__ import annotations

import torch

from headmoe.pipeline.health import DECODER_HINT, check_media

WAN22_LATENT_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENT_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip
LATENT_CHANNELS = 48


def latent_stats() -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)``, each ``[48]`` float32."""
    return (
        torch.tensor(WAN22_LATENT_MEAN, dtype=torch.float32),
        torch.tensor(WAN22_LATENT_STD, dtype=torch.float32),
    )


def _scale(x: torch.Tensor, channel_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, 1/std)`` float32, shaped to broadcast along ``channel_dim`` of ``x`` (which
    must be 48 wide there), on ``x``'s device; the reciprocal taken once in float32, as the
    release's ``scale = [mean, 1/std]``."""
    if x.shape[channel_dim] != LATENT_CHANNELS:
        raise ValueError(
            f"latent has {x.shape[channel_dim]} channels on dim {channel_dim}, "
            f"expected {LATENT_CHANNELS}"
        )
    mean, std = latent_stats()
    view = [1] * x.dim()
    view[channel_dim] = LATENT_CHANNELS
    return mean.view(view).to(x.device), (1.0 / std).view(view).to(x.device)


def denormalize(z: torch.Tensor, channel_dim: int = 1) -> torch.Tensor:
    """``z / (1/std) + mean`` per channel along ``channel_dim`` (48 wide), in ``z``'s dtype.

    The arithmetic runs in float32, as the release's decoders do; this equals
    ``z * std + mean`` to rounding (<= 4e-6 on decoded frames)."""
    mean, inv = _scale(z, channel_dim)
    return (z.float() / inv + mean).to(z.dtype)


def normalize(mu: torch.Tensor, channel_dim: int = 1) -> torch.Tensor:
    """``(mu - mean) * (1/std)`` per channel along ``channel_dim`` in float32, as the
    release's encoder normalises its posterior mean; the inverse of `denormalize` to
    rounding."""
    mean, inv = _scale(mu, channel_dim)
    return (mu.float() - mean) * inv


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """Decoder output ``[B, 3, F, H, W]`` (any float dtype) -> ``[F, H, W, 3]`` uint8 of
    batch item 0, as MAGI-2's ``decode_video``: ``clamp(x * 0.5 + 0.5, 0, 1) * 255`` in
    float32, then truncated (not rounded) to uint8. A NaN/Inf raises `NonFiniteError`
    (it would become a black frame)."""
    if frames.dim() != 5 or frames.shape[1] != 3:
        raise ValueError(f"frames must be [B, 3, F, H, W], got {list(frames.shape)}")
    check_media("after decoding", DECODER_HINT, **{"decoded video": frames[:1]})
    video = frames[:1].float().mul(0.5).add(0.5).clamp(0, 1)
    return video.permute(0, 2, 3, 4, 1).mul(255).to(torch.uint8)[0]


def protocol_latents(latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's ``[T_lat, H_lat, W_lat, 48]`` -> the decoders' ``[1, 48, T, H, W]``."""
    if latents.dim() != 4 or latents.shape[-1] != LATENT_CHANNELS:
        raise ValueError(
            f"video latents must be [T_lat, H_lat, W_lat, {LATENT_CHANNELS}], "
            f"got {list(latents.shape)}"
        )
    return latents.permute(3, 0, 1, 2).unsqueeze(0)
