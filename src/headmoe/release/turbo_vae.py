"""TurboV3 ("TurboV3-Wan22-TinyShallow_7_7"): MAGI-2 Preview's distilled video decoder.

headmoe's own implementation, written from the procedure stated in
``shared/golden/turbo_vae/README.md`` (no package ships this decoder). Decoder only:

- ``conv_in`` (3x3x3, 48 -> W0), a mid block of ResNets, four up blocks (optional
  channel-changing ResNet ``conv_in``, optional upsampler, ResNets), parameter-free RMSNorm,
  SiLU, ``conv_out`` (3x3x3 -> 3 * 2 * 2), then a 2x2 unpatchify to RGB.
- Every 3-D conv pads time by replicating the edge frames and space with zeros (non-causal).
- Windowed decode in time: windows of 7 latent frames (+1 frame of context per inner side),
  see `window_table`. ``T`` latent frames give ``4T - 3`` frames, each side x16.

Module names follow the released checkpoint's ``ema_state_dict`` with ``module.`` stripped,
so ``TurboV3.state_dict()`` has exactly the released names (``decoder.conv_in.conv.weight``
...). Loading: `load_turbo_vae`. Adapter to the pipeline protocol: `TurboVideoDecoder`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headmoe.files import read_json
from headmoe.pipeline.latents import latent_shape
from headmoe.release import video_latents
from headmoe.release.weights import check_tensors, read_tensors

CONFIG_FILE = "TurboV3-Wan22-TinyShallow_7_7.json"
CHECKPOINT_FILE = "checkpoint.ckpt"
# The release's files carry training-only json keys (absorbed by the reference's **kwargs)
# and checkpoint tensors (aligned_feature_projection_*): `unused_entries` reports them.
FINAL_NORM_EPS = 1e-8  # norm1, norm2 and the final norm; norm3 (shortcut) uses resnet_norm_eps


@dataclass(frozen=True)
class TurboVAEConfig:
    """The 19 fields of the decoder's json; defaults are the released values. List fields
    are in *encoder* order (the decoder reverses them)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 48
    decoder_block_out_channels: tuple[int, ...] = (64, 128, 256, 512)
    decoder_layers_per_block: tuple[int, ...] = (2, 2, 2, 3, 3)
    decoder_spatio_temporal_scaling: tuple[bool, ...] = (False, True, True, True)
    decoder_spatio_only: tuple[bool, ...] = (False, True, False, False)
    decoder_is_dw_conv: tuple[bool, ...] = (False, False, False, False, False)
    decoder_dw_kernel_size: int = 5
    decoder_causal: bool = False
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    patch_size: int = 2
    patch_size_t: int = 1
    use_unpatchify: bool = True
    spatial_compression_ratio: int = 16
    temporal_compression_ratio: int = 4
    first_chunk_size: int = 7
    step_size: int = 7

    def __post_init__(self) -> None:
        nb = len(self.decoder_block_out_channels)
        checks = [
            ("decoder_layers_per_block", len(self.decoder_layers_per_block) == nb + 1),
            ("decoder_spatio_temporal_scaling", len(self.decoder_spatio_temporal_scaling) == nb),
            ("decoder_spatio_only", len(self.decoder_spatio_only) == nb),
            ("decoder_is_dw_conv", not any(self.decoder_is_dw_conv)),
            ("decoder_causal", not self.decoder_causal),
            ("patch_size_t", self.patch_size_t == 1),
            ("use_unpatchify", self.use_unpatchify),
            ("first_chunk_size", self.first_chunk_size == self.step_size >= 1),
            ("temporal_compression_ratio", self.temporal_compression_ratio == 4),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(
                    f"TurboV3 config field {name}={getattr(self, name)!r} is not supported "
                    "(headmoe implements the released decoder family only)"
                )

    @classmethod
    def unused_keys(cls, data: Mapping[str, object]) -> list[str]:
        """The keys of a json dict headmoe does not use (training-only ones included, not
        ``_``-prefixed ones): the reference ignores them, so headmoe warns and records them
        (`headmoe.release.folder.unused_entries`) instead of refusing the file."""
        names = {f.name for f in dataclasses.fields(cls)}
        return sorted(k for k in data if k not in names and not k.startswith("_"))

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str = "config") -> TurboVAEConfig:
        """Build from a json dict: known fields are used, the others (`unused_keys`)
        ignored; an unsupported value of a known field is refused naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TurboVAEConfig:
        return cls.from_dict(read_json(path, "TurboV3 config"), source=os.fspath(path))


class TimePadConv3d(nn.Module):
    """Conv3d, stride 1: time padded by replicating the first/last frame ``(kt-1)/2`` times,
    space zero-padded by ``k//2``. ``[B, C, T, H, W] -> [B, C_out, T, H, W]``."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int]):
        super().__init__()
        self.pad_t = (kernel[0] - 1) // 2
        self.conv = nn.Conv3d(cin, cout, kernel, padding=(0, kernel[1] // 2, kernel[2] // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_t:
            p = self.pad_t
            x = torch.cat([x[:, :, :1]] * p + [x] + [x[:, :, -1:]] * p, dim=2)
        return self.conv(x)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free RMSNorm over dim 1 (channels), computed in float32, ``x``'s dtype out."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + eps)).to(x.dtype)


class ResBlock(nn.Module):
    """``conv2(silu(norm2(conv1(act1(norm1(x)))))) + shortcut(x)``; the shortcut is
    ``conv_shortcut(norm3(x))`` (1x1x1) when the width changes, else ``x``."""

    def __init__(self, cin: int, cout: int, eps: float, relu_first: bool):
        super().__init__()
        self.eps, self.relu_first = eps, relu_first
        self.conv1 = TimePadConv3d(cin, cout, (3, 3, 3))
        self.conv2 = TimePadConv3d(cout, cout, (3, 3, 3))
        self.conv_shortcut = TimePadConv3d(cin, cout, (1, 1, 1)) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, FINAL_NORM_EPS)
        h = F.relu(h) if self.relu_first else F.silu(h)
        h = self.conv2(F.silu(rms_norm(self.conv1(h), FINAL_NORM_EPS)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(rms_norm(x, self.eps))
        return h + x


class Upsampler(nn.Module):
    """x2 in space (per frame: nearest-exact in float32, then a 3x3 Conv2d) and, when
    ``temporal``, x2 in time first (``time_conv`` C -> 2C, the halves interleaved as even /
    odd frames; the first frame dropped in the first chunk). Channels are kept."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        self.resample = nn.Sequential(
            nn.Identity(), nn.Conv2d(channels, channels, 3, padding=1)
        )  # index 0 is the (parameter-free) upsampling, as in the checkpoint names
        self.time_conv = TimePadConv3d(channels, 2 * channels, (3, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if self.time_conv is not None:
            y = self.time_conv(x).view(b, 2, c, t, h, w)
            x = y.permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
            if first_chunk:
                x = x[:, :, 1:]
            t = x.shape[2]
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        up = F.interpolate(frames.float(), scale_factor=2.0, mode="nearest-exact").to(x.dtype)
        out = self.resample[1](up)
        return out.view(b, t, c, 2 * h, 2 * w).permute(0, 2, 1, 3, 4)


class UpBlock(nn.Module):
    """``conv_in`` ResNet (only if the width changes), upsampler (optional), ResNets (ReLU
    first when an upsampler precedes them)."""

    def __init__(self, cin: int, cout: int, layers: int, eps: float, up: str | None):
        super().__init__()
        self.conv_in = ResBlock(cin, cout, eps, relu_first=False) if cin != cout else None
        if up is not None:
            self.upsamplers = nn.ModuleList([Upsampler(cout, temporal=up == "3d")])
        else:
            self.upsamplers = None
        relu = up is not None
        self.resnets = nn.ModuleList(ResBlock(cout, cout, eps, relu) for _ in range(layers))

    def forward(self, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, first_chunk)
        for r in self.resnets:
            x = r(x)
        return x


class MidBlock(nn.Module):
    def __init__(self, channels: int, layers: int, eps: float):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResBlock(channels, channels, eps, False) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in self.resnets:
            x = r(x)
        return x


class TurboDecoder(nn.Module):
    """One window: ``[B, 48, T, h, w]`` (de-normalised) -> ``[B, 3, 4T-3 or 4T, 16h, 16w]``.

    ``trace`` (a dict), when given, receives the outputs of ``conv_in``, ``mid_block`` and
    each ``up_blocks.<i>`` under those names."""

    def __init__(self, cfg: TurboVAEConfig):
        super().__init__()
        widths = list(reversed(cfg.decoder_block_out_channels))
        layers = list(reversed(cfg.decoder_layers_per_block))
        scaling = list(reversed(cfg.decoder_spatio_temporal_scaling))
        spatial_only = list(reversed(cfg.decoder_spatio_only))
        eps, self.patch = cfg.resnet_norm_eps, cfg.patch_size
        self.conv_in = TimePadConv3d(cfg.latent_channels, widths[0], (3, 3, 3))
        self.mid_block = MidBlock(widths[0], layers[0], eps)
        blocks, cin = [], widths[0]
        for i, cout in enumerate(widths):
            up = None if not scaling[i] else ("2d" if spatial_only[i] else "3d")
            blocks.append(UpBlock(cin, cout, layers[i + 1], eps, up))
            cin = cout
        self.up_blocks = nn.ModuleList(blocks)
        self.conv_out = TimePadConv3d(cin, cfg.out_channels * self.patch**2, (3, 3, 3))

    def forward(
        self, z: torch.Tensor, first_chunk: bool, trace: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        x = self.conv_in(z)
        self._record(trace, "conv_in", x)
        x = self.mid_block(x)
        self._record(trace, "mid_block", x)
        for i, block in enumerate(self.up_blocks):
            x = block(x, first_chunk)
            self._record(trace, f"up_blocks.{i}", x)
        x = self.conv_out(F.silu(rms_norm(x, FINAL_NORM_EPS)))
        return unpatchify(x, self.patch)

    @staticmethod
    def _record(trace: dict[str, torch.Tensor] | None, name: str, x: torch.Tensor) -> None:
        if trace is not None:
            trace[name] = x.detach().clone()


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, C*p*p, F, h, w] -> [B, C, F, p*h, p*w]`` with
    ``out[b, c, f, p*h+i, p*w+j] = x[b, c*p*p + p*j + i, f, h, w]`` (column offset first)."""
    b, cpp, f, h, w = x.shape
    c = cpp // (p * p)
    y = x.view(b, c, p, p, f, h, w)  # (b, c, j, i, f, h, w)
    return y.permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c, f, h * p, w * p)


def pad_count(n: int, first: int = 7, step: int = 7) -> int:
    """Latent frames appended (copies of the last) so that ``n + pad = first + step*k``."""
    if n < 1:
        raise ValueError(f"latent frame count must be >= 1, got {n}")
    if n < first:
        return first - n
    return (step - (n - first) % step) % step


def window_table(n_padded: int, first: int = 7, step: int = 7, ratio: int = 4) -> list[tuple]:
    """``(left, right, is_first_chunk, trim_left, trim_right)`` per window over a padded
    latent of ``n_padded = first + step*k`` frames; a window decodes latents
    ``[left, right)`` and drops ``trim_*`` pixel frames at its ends."""
    if n_padded < first or (n_padded - first) % step:
        raise ValueError(f"padded latent length {n_padded} is not {first} + {step}*k")
    if n_padded == first:
        return [(0, first, 1, 0, 0)]
    table = [(0, first + 1, 1, 0, ratio)]
    for i in range(first, n_padded, step):
        last = i + step == n_padded
        table.append((i - 1, i + step + (0 if last else 1), 0, ratio, 0 if last else ratio))
    return table


class TurboV3(nn.Module):
    """The released module tree: ``decoder`` (`TurboDecoder`) plus the windowed `decode`."""

    def __init__(self, cfg: TurboVAEConfig | None = None):
        super().__init__()
        self.config = cfg or TurboVAEConfig()
        self.decoder = TurboDecoder(self.config)

    @torch.no_grad()
    def decode(self, z: torch.Tensor, trace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Normalised latents ``[B, 48, N, h, w]`` -> frames ``[B, 3, 4N-3, 16h, 16w]`` in the
        model dtype, unclamped. ``trace`` receives ``latent_denorm_padded``, ``windows``
        (int64 ``[n, 5]``) and ``window0.<stage>``."""
        cfg = self.config
        dtype = next(self.parameters()).dtype
        x = video_latents.denormalize(z.to(dtype), channel_dim=1)
        n = x.shape[2]
        pad = pad_count(n, cfg.first_chunk_size, cfg.step_size)
        if pad:
            x = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        table = window_table(
            n + pad, cfg.first_chunk_size, cfg.step_size, cfg.temporal_compression_ratio
        )
        if trace is not None:
            trace["latent_denorm_padded"] = x.clone()
            trace["windows"] = torch.tensor(table, dtype=torch.int64)
        pieces = []
        for k, (left, right, first, trim_l, trim_r) in enumerate(table):
            sub = {} if (trace is not None and k == 0) else None
            out = self.decoder(x[:, :, left:right], bool(first), sub)
            if sub is not None:
                trace.update({f"window0.{name}": v for name, v in sub.items()})
            pieces.append(out[:, :, trim_l : out.shape[2] - trim_r])
        frames = torch.cat(pieces, dim=2)
        return frames[:, :, : frames.shape[2] - cfg.temporal_compression_ratio * pad]


def turbo_state_dict(raw: Mapping[str, object], source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The decoder tensors of a TurboV3 checkpoint object, ``module.`` stripped, and the
    prefix the file uses (``"module."`` or ``""``, for messages in the file's spelling).

    ``raw`` is a file's top-level dict: ``{"ema_state_dict": ...}`` (preferred, as the
    release's loader does), ``{"state_dict": ...}``, or a flat name -> tensor dict. Names are
    ``module.decoder.*`` or ``decoder.*``; every other entry (the training-only projection
    heads, optimizer state, ...) is not used, as by the reference (`unused_state`)."""
    raw = _decoder_dict(raw)
    prefix = "module." if any(k.startswith("module.") for k in raw) else ""
    state = {name.removeprefix("module."): value for name, value in raw.items()
             if _is_decoder_tensor(name, value)}
    return state, prefix


def _decoder_dict(raw: Mapping[str, object]) -> Mapping[str, object]:
    for key in ("ema_state_dict", "state_dict"):
        if isinstance(raw.get(key), Mapping):
            return raw[key]  # type: ignore[return-value]
    return raw


def _is_decoder_tensor(name: str, value: object) -> bool:
    return name.removeprefix("module.").startswith("decoder.") and isinstance(value, torch.Tensor)


def unused_state(raw: Mapping[str, object]) -> list[str]:
    """The entries of a TurboV3 checkpoint object headmoe does not use: top-level keys
    beside the state dict it reads and that dict's entries that are not decoder tensors
    (training-only state); warned about and recorded, not refused."""
    state = _decoder_dict(raw)
    outer = [k for k in raw if raw.get(k) is not state] if state is not raw else []
    return outer + [k for k, v in state.items() if not _is_decoder_tensor(k, v)]


def unused_entries(folder: str | os.PathLike) -> list[str]:
    """``"<file>: <entries>"`` for each file of a ``turbo_vae/`` folder with entries headmoe
    does not use (`TurboVAEConfig.unused_keys`, `unused_state`); the checkpoint is
    memory-mapped, no weight is copied."""
    folder = os.fspath(folder)
    out = []
    keys = TurboVAEConfig.unused_keys(read_json(os.path.join(folder, CONFIG_FILE),
                                                "TurboV3 config"))
    entries = unused_state(read_tensors(os.path.join(folder, CHECKPOINT_FILE)))
    for name, unused in ((CONFIG_FILE, keys), (CHECKPOINT_FILE, entries)):
        if unused:
            out.append(f"{name}: {', '.join(map(str, unused))}")
    return out


def build_turbo_vae(cfg: TurboVAEConfig | None = None, device: str = "meta") -> TurboV3:
    """An uninitialised `TurboV3` (on the meta device by default: names and shapes only)."""
    with torch.device(device):
        return TurboV3(cfg)


def _checked_state(
    path: str | os.PathLike, config: TurboVAEConfig | None
) -> tuple[dict[str, torch.Tensor], TurboV3]:
    """The checked decoder tensors of ``path`` (memory-mapped, not copied) and the meta
    model they fit; see `load_turbo_vae`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        cfg_file = os.path.join(path, CONFIG_FILE)
        if config is None:
            if not os.path.isfile(cfg_file):
                raise ValueError(f"TurboV3 folder {path!r} has no {CONFIG_FILE}")
            config = TurboVAEConfig.from_json(cfg_file)
        path = os.path.join(path, CHECKPOINT_FILE)
    state, prefix = turbo_state_dict(read_tensors(path), path)
    model = build_turbo_vae(config)
    check_tensors(
        {prefix + k: v for k, v in state.items()},
        {prefix + k: v.shape for k, v in model.state_dict().items()},
        path,
    )
    return state, model


def check_turbo_vae(path: str | os.PathLike, config: TurboVAEConfig | None = None) -> TurboVAEConfig:
    """Check a ``turbo_vae/`` folder (or checkpoint file) as `load_turbo_vae` would, without
    copying any weight (the pickle is memory-mapped); returns the configuration. Raises
    `ValueError` naming the file or tensors."""
    return _checked_state(path, config)[1].config


def load_turbo_vae(
    path: str | os.PathLike,
    config: TurboVAEConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> TurboV3:
    """Load a TurboV3 decoder.

    ``path`` is the release's ``turbo_vae/`` folder (``TurboV3-Wan22-TinyShallow_7_7.json``
    + ``checkpoint.ckpt``) or a checkpoint file (``.ckpt``/``.pth`` torch pickle read with
    ``weights_only=True, mmap=True``, or ``.safetensors``); for a file, ``config`` defaults to
    the released configuration. Every missing/unexpected/mis-shaped tensor is reported by
    name before anything is loaded. Weights end up in ``dtype`` on ``device`` (MAGI-2 runs it
    in bf16; the golden data is float32)."""
    state, model = _checked_state(path, config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


class TurboVideoDecoder:
    """`headmoe.pipeline.interfaces.VideoDecoder` over a `TurboV3`: pipeline latents
    ``[T_lat, H_lat, W_lat, 48]`` (normalised, fp32) -> uint8 ``[num_frames, 16 H_lat,
    16 W_lat, 3]``. De-normalisation happens inside `TurboV3.decode`."""

    latent_channels = video_latents.LATENT_CHANNELS

    def __init__(self, model: TurboV3):
        self.model = model

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, dtype: torch.dtype = torch.bfloat16):
        return cls(load_turbo_vae(folder, dtype=dtype))

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        return latent_shape(num_frames, height, width)

    def decode(self, latents: torch.Tensor, num_frames: int) -> torch.Tensor:
        z = video_latents.protocol_latents(latents)
        frames = self.model.decode(z.to(next(self.model.parameters()).device))
        if num_frames > frames.shape[2]:
            raise ValueError(f"num_frames={num_frames} > {frames.shape[2]} decoded frames")
        return video_latents.frames_to_uint8(frames[:, :, :num_frames].cpu())


def build_tiny_turbo_vae(
    folder: str | os.PathLike, seed: int = 1002, widths: tuple[int, ...] = (8, 16, 24, 32)
) -> str:
    """Write a tiny random TurboV3 as the release's ``turbo_vae/`` folder (``CONFIG_FILE``
    with the training-only keys too, ``checkpoint.ckpt`` = ``{"ema_state_dict":
    {"module.decoder.*": ...}}``). Deterministic; returns the folder. Weights: conv
    N(0, 1/fan_in) (ResNet ``conv2`` x0.5), biases N(0, 0.05^2)."""
    folder = os.fspath(folder)
    cfg = TurboVAEConfig(decoder_block_out_channels=tuple(widths))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in build_turbo_vae(cfg).state_dict().items():
        if name.endswith(".weight"):
            fan_in = math.prod(p.shape[1:])
            gain = 0.5 if ".conv2." in name else 1.0
            value = torch.randn(p.shape, generator=gen) * (gain / math.sqrt(fan_in))
        else:
            value = 0.05 * torch.randn(p.shape, generator=gen)
        state[f"module.{name}"] = value
    os.makedirs(folder, exist_ok=True)
    data = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    data.update(
        aligned_feature_projection_mode="conv-2layer",
        aligned_feature_projection_dim=[[512, 1024], [512, 1024]],
        aligned_blks_indices=[0, 1],
    )
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(data, f, indent=1)
    torch.save({"ema_state_dict": state}, os.path.join(folder, CHECKPOINT_FILE))
    return folder
