"""The full Wan2.2 video VAE (``vae/Wan2.2_VAE.pth``) through ``diffusers.AutoencoderKLWan``.

The release's ``.pth`` is a plain state dict in Wan2.2's original key layout, which
diffusers' own single-file loader does not read. `wan_name` renames it (by position in the
dotted name; rules in ``shared/golden/wan22_vae/README.md``); nothing is reshaped. Decoding
de-normalises the 48-channel latents (`video_latents.denormalize`) and calls
``AutoencoderKLWan.decode`` (which clamps to [-1, 1]): ``T`` latent frames -> ``4T - 3``
frames, x16 spatially. Loader: `load_wan_vae`; pipeline adapter: `WanVideoDecoder`.

The image-to-video encoder (`load_wan_encoder`, `WanImageEncoder`) uses the encoder half
of the same file: ``AutoencoderKLWan.encode`` of one frame, the posterior **mean** (no
sampling), normalised with the same statistics (`video_latents.normalize`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

from headmoe.pipeline.latents import latent_shape
from headmoe.release import video_latents
from headmoe.release.weights import check_tensors, read_tensors

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


_RES_INV = {v: k for k, v in _RES.items()}


def _res_original(parts: list[str], name: str) -> str:
    if parts[0] == "conv_shortcut" and len(parts) == 2:
        return f"shortcut.{parts[1]}"
    if len(parts) == 2 and parts[0] in _RES_INV:
        return ".".join((*_RES_INV[parts[0]], parts[1]))
    raise ValueError(f"AutoencoderKLWan tensor {name!r}: unknown resnet entry")


def wan_original_name(name: str, num_res_blocks: int = 2) -> str:
    """Inverse of `wan_name`: a diffusers ``AutoencoderKLWan`` name -> the ``.pth`` name."""
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    p = name.split(".")
    if p[0] in top and len(p) == 2:
        return f"{top[p[0]]}.{p[1]}"
    side, rest = p[0], p[1:]
    if side not in ("encoder", "decoder") or not rest:
        raise ValueError(f"AutoencoderKLWan tensor {name!r}: unknown layout")
    simple = {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}
    if rest[0] in simple and len(rest) == 2:
        return f"{side}.{simple[rest[0]]}.{rest[1]}"
    if rest[:3] == ["mid_block", "attentions", "0"]:
        return f"{side}.middle.1.{'.'.join(rest[3:])}"
    if rest[:2] == ["mid_block", "resnets"] and len(rest) >= 4:
        return f"{side}.middle.{2 * int(rest[2])}.{_res_original(rest[3:], name)}"
    group = "downsamples" if side == "encoder" else "upsamples"
    if rest[0] in ("down_blocks", "up_blocks") and len(rest) >= 4:
        i, kind = rest[1], rest[2]
        if kind in ("downsampler", "upsampler"):
            j = num_res_blocks if side == "encoder" else num_res_blocks + 1
            return f"{side}.{group}.{i}.{group}.{j}.{'.'.join(rest[3:])}"
        if kind == "resnets" and len(rest) >= 5:
            return f"{side}.{group}.{i}.{group}.{rest[3]}.{_res_original(rest[4:], name)}"
    raise ValueError(f"AutoencoderKLWan tensor {name!r}: unknown layout")


def config_for(state: Mapping[str, torch.Tensor], source: str) -> dict:
    """`RELEASED_CONFIG` with the widths read from the file (``encoder.conv1`` gives
    ``base_dim``, ``decoder.conv1`` gives ``decoder_base_dim * dim_mult[-1]``), so a
    narrowed VAE in the release's layout loads without a separate config."""
    try:
        base = state["encoder.conv1.weight"].shape[0]
        dec = state["decoder.conv1.weight"].shape[0] // RELEASED_CONFIG["dim_mult"][-1]
    except KeyError as exc:
        raise ValueError(f"{source}: missing tensor {exc.args[0]}") from None
    return dict(RELEASED_CONFIG, base_dim=int(base), decoder_base_dim=int(dec))


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


def _checked_state(path: str | os.PathLike, config: Mapping | None):
    """The checked tensors of ``path`` under diffusers names (memory-mapped) and the meta
    ``AutoencoderKLWan`` they fit; see `load_wan_vae`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_FILE)
    raw = read_tensors(path)
    if not all(isinstance(v, torch.Tensor) for v in raw.values()):
        bad = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
        raise ValueError(f"{path}: entries that are not tensors: {', '.join(bad)}")
    renamed = rename_state_dict(raw, path)
    aliases = dict(zip(renamed, raw))
    model = build_wan_vae(config or config_for(raw, path), "meta")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_tensors(renamed, expected, f"{path} (diffusers names)", aliases)
    return renamed, model


def check_wan_vae(path: str | os.PathLike, config: Mapping | None = None) -> None:
    """Check ``Wan2.2_VAE.pth`` (or its folder) as `load_wan_vae` would, without copying any
    weight (memory-mapped). Raises `ValueError` naming the file or tensors."""
    _checked_state(path, config)


def load_wan_vae(
    path: str | os.PathLike,
    config: Mapping | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
):
    """Load ``Wan2.2_VAE.pth`` (or a folder holding it; torch pickle read with
    ``weights_only=True, mmap=True``, or a ``.safetensors`` file in the same layout) into
    ``AutoencoderKLWan`` built with ``config`` (default: `config_for` the file, i.e. the
    released configuration with the file's widths). Every missing,
    unexpected or mis-shaped tensor is reported by name before loading."""
    renamed, model = _checked_state(path, config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in renamed.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


#: the parts of ``AutoencoderKLWan`` that encoding uses (the decoder is never materialised)
ENCODER_PARTS = ("encoder.", "quant_conv.")


def load_wan_encoder(
    path: str | os.PathLike,
    config: Mapping | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """``AutoencoderKLWan`` of ``Wan2.2_VAE.pth`` (or its folder) with only `ENCODER_PARTS`
    loaded: every tensor of the file is checked as `load_wan_vae` does, the encoder and
    ``quant_conv`` are loaded strictly, and the decoder half is dropped (never allocated)."""
    renamed, model = _checked_state(path, config)
    for part in (p.rstrip(".") for p in ENCODER_PARTS):
        sub = {k[len(part) + 1:]: v.to(device=device, dtype=dtype)
               for k, v in renamed.items() if k.startswith(part + ".")}
        getattr(model, part).load_state_dict(sub, strict=True, assign=True)
    del model.decoder, model.post_quant_conv
    return model.eval()


class WanImageEncoder:
    """The I2V image encoder: VAE input ``[1, 3, 1, H, W]`` float32 in [-1, 1] (H, W
    multiples of 32) -> normalised posterior mean ``[1, 48, 1, H/16, W/16]`` float32."""

    def __init__(self, vae):
        self.vae = vae

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dim() != 5 or pixels.shape[:3] != (1, 3, 1):
            raise ValueError(f"pixels must be [1, 3, 1, H, W], got {list(pixels.shape)}")
        p = next(self.vae.parameters())
        mu = self.vae.encode(pixels.to(device=p.device, dtype=p.dtype)).latent_dist.mode()
        return video_latents.normalize(mu, channel_dim=1).cpu()


def build_tiny_wan_vae(
    folder: str | os.PathLike, seed: int = 1004, base_dim: int = 6, decoder_base_dim: int = 8
) -> str:
    """Write a tiny random Wan2.2 VAE as the release's ``vae/`` folder: ``Wan2.2_VAE.pth``, a
    plain state dict in the original key layout, that `load_wan_vae` reads without a config.
    Deterministic; returns the folder. Weights: conv N(0, 1/fan_in) (``residual.6`` and the
    attention ``proj`` x0.5), RMSNorm gammas 1, biases N(0, 0.05^2)."""
    folder = os.fspath(folder)
    cfg = dict(RELEASED_CONFIG, base_dim=base_dim, decoder_base_dim=decoder_base_dim)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in build_wan_vae(cfg).state_dict().items():
        original = wan_original_name(name, cfg["num_res_blocks"])
        if name.endswith(".gamma"):
            value = torch.ones(p.shape)
        elif name.endswith(".weight"):
            gain = 0.5 if original.endswith(("residual.6.weight", "proj.weight")) else 1.0
            value = torch.randn(p.shape, generator=gen) * (gain / math.sqrt(math.prod(p.shape[1:])))
        else:
            value = 0.05 * torch.randn(p.shape, generator=gen)
        state[original] = value
    os.makedirs(folder, exist_ok=True)
    torch.save(state, os.path.join(folder, CHECKPOINT_FILE))
    return folder


class WanVideoDecoder:
    """`headmoe.pipeline.interfaces.VideoDecoder` over ``AutoencoderKLWan``: pipeline latents
    ``[T_lat, H_lat, W_lat, 48]`` (normalised) -> uint8 ``[num_frames, 16 H_lat, 16 W_lat, 3]``."""

    latent_channels = video_latents.LATENT_CHANNELS

    def __init__(self, vae):
        self.vae = vae

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        return latent_shape(num_frames, height, width)

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
