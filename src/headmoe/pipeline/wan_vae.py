"""The full Wan2.2 video VAE (``vae/Wan2.2_VAE.pth``) through ``diffusers.AutoencoderKLWan``.

The release's ``.pth`` is a plain state dict in Wan2.2's original key layout, which
diffusers' own single-file loader does not read. `wan_name` renames it (by position in the
dotted name; rules in ``shared/golden/wan22_vae/README.md``); nothing is reshaped. Decoding
de-normalises the 48-channel latents (`video_latents.denormalize`) and calls
``AutoencoderKLWan.decode`` (which clamps to [-1, 1]): ``T`` latent frames -> ``4T - 3``
frames, x16 spatially. Loader: `load_wan_vae`; pipeline adapter: `WanVideoDecoder`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from headmoe.pipeline import video_latents
from headmoe.pipeline.weights import check_tensors, read_tensors

CHECKPOINT_FILE = "Wan2.2_VAE.pth"
# AutoencoderKLWan arguments of the released VAE (z_dim 48); == diffusers'
# scripts/convert_wan_to_diffusers.py vae22_diffusers_config, less ``clip_output``.
RELEASED_CONFIG = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "latents_mean": list(video_latents.WAN22_LATENT_MEAN),
    "latents_std": list(video_latents.WAN22_LATENT_STD),
}
_RES = {
    ("residual", "0"): "norm1",
    ("residual", "2"): "conv1",
    ("residual", "3"): "norm2",
    ("residual", "6"): "conv2",
}


def _res_name(parts: list[str], name: str) -> str:
    """Inside a residual block: ``residual.{0,2,3,6}`` / ``shortcut`` -> diffusers names."""
    if parts[:1] == ["shortcut"] and len(parts) == 2:
        return f"conv_shortcut.{parts[1]}"
    if len(parts) == 3 and tuple(parts[:2]) in _RES:
        return f"{_RES[tuple(parts[:2])]}.{parts[2]}"
    raise ValueError(
        f"Wan2.2 VAE tensor {name!r}: unknown residual-block entry {'.'.join(parts)!r}"
    )


def _side_name(side: str, parts: list[str], name: str) -> str:
    """``encoder.*`` / ``decoder.*`` below the side (``parts`` excludes it)."""
    head, rest = parts[0], parts[1:]
    if head == "conv1" and len(rest) == 1:
        return f"{side}.conv_in.{rest[0]}"
    if head == "head" and rest[:1] in (["0"], ["2"]) and len(rest) == 2:
        return f"{side}.{'norm_out' if rest[0] == '0' else 'conv_out'}.{rest[1]}"
    if head == "middle" and rest[:1] == ["1"]:
        return f"{side}.mid_block.attentions.0.{'.'.join(rest[1:])}"
    if head == "middle" and rest[:1] in (["0"], ["2"]):
        return f"{side}.mid_block.resnets.{int(rest[0]) // 2}.{_res_name(rest[1:], name)}"
    group = "downsamples" if side == "encoder" else "upsamples"
    if head == group and len(rest) >= 4 and rest[1] == group:
        block, j, inner = rest[0], rest[2], rest[3:]
        kind = "down_blocks" if side == "encoder" else "up_blocks"
        if inner[0] in ("resample", "time_conv"):
            sampler = "downsampler" if side == "encoder" else "upsampler"
            return f"{side}.{kind}.{block}.{sampler}.{'.'.join(inner)}"
        return f"{side}.{kind}.{block}.resnets.{j}.{_res_name(inner, name)}"
    raise ValueError(f"Wan2.2 VAE tensor {name!r}: unknown layout")


def wan_name(name: str) -> str:
    """The diffusers ``AutoencoderKLWan`` name of a tensor of ``Wan2.2_VAE.pth``.

    >>> wan_name("decoder.upsamples.2.upsamples.0.residual.2.weight")
    'decoder.up_blocks.2.resnets.0.conv1.weight'
    """
    parts = name.split(".")
    if parts[0] in ("conv1", "conv2") and len(parts) == 2:
        return f"{'quant_conv' if parts[0] == 'conv1' else 'post_quant_conv'}.{parts[1]}"
    if parts[0] in ("encoder", "decoder") and len(parts) >= 3:
        return _side_name(parts[0], parts[1:], name)
    raise ValueError(f"Wan2.2 VAE tensor {name!r}: unknown layout")


def rename_state_dict(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """All tensors under diffusers names; every name that fits no rule is reported."""
    out, refused = {}, []
    for key, value in state.items():
        try:
            out[wan_name(key)] = value
        except ValueError:
            refused.append(key)
    if refused:
        raise ValueError(f"{source}: unexpected tensors: {', '.join(refused)}")
    return out


def build_wan_vae(config: Mapping | None = None, device: str | torch.device = "meta"):
    """``AutoencoderKLWan(**config)`` (released configuration by default), on ``device``."""
    from diffusers import AutoencoderKLWan

    with torch.device(device):
        return AutoencoderKLWan(**dict(config or RELEASED_CONFIG))


def load_wan_vae(
    path: str | os.PathLike,
    config: Mapping | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
):
    """Load ``Wan2.2_VAE.pth`` (or a folder holding it; torch pickle read with
    ``weights_only=True, mmap=True``, or a ``.safetensors`` file in the same layout) into
    ``AutoencoderKLWan`` built with ``config`` (default `RELEASED_CONFIG`). Every missing,
    unexpected or mis-shaped tensor is reported by name before loading."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_FILE)
    raw = read_tensors(path)
    if not all(isinstance(v, torch.Tensor) for v in raw.values()):
        bad = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
        raise ValueError(f"{path}: entries that are not tensors: {', '.join(bad)}")
    renamed = rename_state_dict(raw, path)
    aliases = dict(zip(renamed, raw))
    model = build_wan_vae(config, "meta")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_tensors(renamed, expected, f"{path} (diffusers names)", aliases)
    state = {k: v.to(device=device, dtype=dtype) for k, v in renamed.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


class WanVideoDecoder:
    """`headmoe.pipeline.encoders.VideoDecoder` over ``AutoencoderKLWan``: pipeline latents
    ``[T_lat, H_lat, W_lat, 48]`` (normalised) -> uint8 ``[num_frames, 16 H_lat, 16 W_lat, 3]``."""

    latent_channels = video_latents.LATENT_CHANNELS

    def __init__(self, vae):
        self.vae = vae

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        return video_latents.latent_shape(num_frames, height, width)

    @torch.no_grad()
    def decode_frames(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised ``[B, 48, T, h, w]`` -> ``[B, 3, 4T-3, 16h, 16w]`` in [-1, 1] (model
        dtype): de-normalise, then ``AutoencoderKLWan.decode``."""
        p = next(self.vae.parameters())
        x = video_latents.denormalize(z.to(device=p.device, dtype=p.dtype), channel_dim=1)
        return self.vae.decode(x).sample

    def decode(self, latents: torch.Tensor, num_frames: int) -> torch.Tensor:
        frames = self.decode_frames(video_latents.protocol_latents(latents))
        if num_frames > frames.shape[2]:
            raise ValueError(f"num_frames={num_frames} > {frames.shape[2]} decoded frames")
        return video_latents.frames_to_uint8(frames[:, :, :num_frames].cpu())
