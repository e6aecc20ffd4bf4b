"""Stable-Audio-Open-1.0 VAE decoder ("Oobleck") for MAGI-2 audio latents.

The release ships ``stable-audio-open-1.0/`` (``model_config.json`` + ``model.safetensors``)
in the stable-audio-tools layout (decoder under ``pretransform.model.decoder.*``). headmoe
renames those keys to ``diffusers.models.autoencoders.autoencoder_oobleck.OobleckDecoder``'s
(`oobleck_name`; snake ``alpha``/``beta`` ``[C] -> [1, C, 1]``, weight-norm tensors as they
are) and runs the decoder only:

    latents [T, 64] --decoder--> [2, 2048 T] at 51.2 kHz --FFT 441/512--> [2, 1764 T] 44.1 kHz

No latent scaling (the release's rescale is mean 0, std 1). Rules and reference numbers:
``shared/golden/stable_audio_vae/README.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from torch import nn

from headmoe.files import read_json
from headmoe.release.weights import check_tensors, open_safetensors

CONFIG_FILE = "model_config.json"
WEIGHTS_FILE = "model.safetensors"
DECODER_PREFIX = "pretransform.model.decoder."
ENCODER_PREFIX = "pretransform.model.encoder."
# Parts of the release file that a decoder does not read (encoder, DiT, number conditioners).
OTHER_PARTS = (ENCODER_PREFIX, "model.model.", "conditioner.conditioners.")
LATENT_FPS = 25  # MAGI-2 audio latents per second of video
RESAMPLE_NUM, RESAMPLE_DEN = 441, 512  # 51.2 kHz -> 44.1 kHz
OUTPUT_SAMPLE_RATE = 44100  # Hz of the waveform headmoe writes (after the resampling)


def audio_latent_length(duration_s: float) -> int:
    """Audio latents of a ``duration_s``-second clip: `LATENT_FPS` per second, rounded up
    (at least 1); the one rule of every audio decoder, the planner and admission."""
    return max(1, math.ceil(round(duration_s * LATENT_FPS, 9)))
RES_UNIT = ("snake1", "conv1", "snake2", "conv2")  # residual unit layers.0..3


@dataclass(frozen=True)
class OobleckConfig:
    """The decoder fields of stable-audio-tools' ``model.pretransform.config.decoder``;
    defaults are the released values (``channels`` 128; the golden tiny model uses 8)."""

    channels: int = 128
    c_mults: tuple[int, ...] = (1, 2, 4, 8, 16)
    strides: tuple[int, ...] = (2, 4, 4, 8, 8)  # encoder order; the decoder reverses them
    latent_dim: int = 64
    out_channels: int = 2
    sample_rate: int = 44100

    @property
    def hop(self) -> int:
        """Output samples per latent (2048)."""
        return math.prod(self.strides)

    @classmethod
    def from_model_config(cls, data: dict, source: str) -> OobleckConfig:
        """From a stable-audio-tools ``model_config.json`` dict; refuses decoders that
        diffusers' `OobleckDecoder` cannot express (no snake, a final tanh)."""
        try:
            dec = data["model"]["pretransform"]["config"]["decoder"]
            cfg = dec["config"]
            kind = dec["type"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: no model.pretransform.config.decoder ({exc})") from None
        if kind != "oobleck":
            raise ValueError(f"{source}: decoder type {kind!r}, expected 'oobleck'")
        for key, want in (("use_snake", True), ("final_tanh", False)):
            if cfg.get(key, want) != want:
                raise ValueError(f"{source}: decoder {key}={cfg[key]!r} is not supported")
        return cls(
            channels=int(cfg["channels"]),
            c_mults=tuple(cfg["c_mults"]),
            strides=tuple(cfg["strides"]),
            latent_dim=int(cfg["latent_dim"]),
            out_channels=int(cfg["out_channels"]),
            sample_rate=int(data.get("sample_rate", 44100)),
        )

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        """diffusers' `OobleckDecoder` with this configuration (uninitialised on meta)."""
        from diffusers.models.autoencoders.autoencoder_oobleck import OobleckDecoder

        with torch.device(device):
            return OobleckDecoder(
                channels=self.channels,
                input_channels=self.latent_dim,
                audio_channels=self.out_channels,
                upsampling_ratios=list(reversed(self.strides)),
                channel_multiples=list(self.c_mults),
            )


_PREFIX = {"decoder": DECODER_PREFIX, "encoder": ENCODER_PREFIX}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _inner(rest: str, names: dict[int, str], full: str) -> str:
    m = _LAYER.fullmatch(rest)
    if not m or int(m.group(1)) not in names:
        raise ValueError(f"stable-audio-tools tensor {full!r}: unexpected layer {rest!r}")
    return f"{names[int(m.group(1))]}.{m.group(2)}"


def _res_unit(prefix: str, rest: str, full: str) -> str:
    return f"{prefix}.{_inner(rest, dict(enumerate(RES_UNIT)), full)}"


def oobleck_name(name: str, n_blocks: int = 5) -> str | None:
    """diffusers name (``decoder.*`` / ``encoder.*`` of `AutoencoderOobleck`) for a tensor of
    the stable-audio-tools file, or None for the parts no VAE holds (DiT, conditioners).

    Renaming is by position in the dotted name (see module doc); an unknown layout raises
    `ValueError` naming the tensor."""
    side = next((s for s in ("decoder", "encoder") if name.startswith(_PREFIX[s])), None)
    if side is None:
        if name.startswith(OTHER_PARTS):
            return None
        raise ValueError(f"stable-audio-tools tensor {name!r} is in no known part of the file")
    prefix = _PREFIX[side]
    m = _LAYER.fullmatch(name.removeprefix(prefix))
    if not m:
        raise ValueError(f"stable-audio-tools tensor {name!r}: expected {prefix}layers.<i>.*")
    i, rest = int(m.group(1)), m.group(2)
    ends = {0: "conv1", n_blocks + 1: "snake1", n_blocks + 2: "conv2"}
    if i in ends:
        return f"{side}.{ends[i]}.{rest}"
    if not 1 <= i <= n_blocks:
        raise ValueError(f"stable-audio-tools tensor {name!r}: layer {i} out of range")
    block = f"{side}.block.{i - 1}"
    if side == "decoder":
        inner = {0: "snake1", 1: "conv_t1", 2: "res_unit1", 3: "res_unit2", 4: "res_unit3"}
    else:
        inner = {0: "res_unit1", 1: "res_unit2", 2: "res_unit3", 3: "snake1", 4: "conv1"}
    sub = _inner(rest, inner, name)
    unit, _, tail = sub.partition(".")
    if unit.startswith("res_unit"):
        return _res_unit(f"{block}.{unit}", tail, name)
    return f"{block}.{sub}"


def oobleck_tensor(name: str, value: torch.Tensor) -> torch.Tensor:
    """The value under the diffusers name: snake ``alpha``/``beta`` ``[C] -> [1, C, 1]``
    (log-scale values unchanged), everything else as it is."""
    if name.rsplit(".", 1)[-1] in ("alpha", "beta"):
        return value.reshape(1, -1, 1)
    return value


def fft_resample(x: torch.Tensor, num: int, dim: int = -1) -> torch.Tensor:
    """FFT resampling of the whole signal along ``dim`` to ``num`` samples (periodic, no
    window; the arithmetic of ``scipy.signal.resample`` for real input), computed in float64,
    returned in ``x``'s dtype. Downsampling keeps bins ``0..num/2`` and doubles bin ``num/2``
    when ``num`` is even (the unpaired Nyquist bin); then ``irfft(n=num) * num / N``."""
    n = x.shape[dim]
    if num == n:
        return x.clone()
    if not 1 <= num < n:
        raise ValueError(f"fft_resample: num={num} must be in [1, {n}] (downsampling only)")
    spec = torch.fft.rfft(x.double(), dim=dim)
    spec = spec.narrow(dim if dim >= 0 else x.dim() + dim, 0, num // 2 + 1).clone()
    if num % 2 == 0:
        spec.select(dim, num // 2).mul_(2)
    out = torch.fft.irfft(spec, n=num, dim=dim) * (num / n)
    return out.to(x.dtype)


def resample_51200_to_44100(audio: torch.Tensor) -> torch.Tensor:
    """``[C, 2048 T]`` at 51.2 kHz -> ``[C, 1764 T]`` at 44.1 kHz (exact 441/512)."""
    n = audio.shape[-1]
    return fft_resample(audio, n * RESAMPLE_NUM // RESAMPLE_DEN, dim=-1)


def _read_decoder(path: str, cfg: OobleckConfig, decoder: nn.Module) -> dict[str, torch.Tensor]:
    """Decoder tensors of the release file in diffusers names (only these are read)."""
    renamed = _decoder_names(path, cfg, decoder)
    with open_safetensors(path) as f:
        return {n: oobleck_tensor(n, f.get_tensor(k)) for n, k in renamed.items()}


def _decoder_names(path: str, cfg: OobleckConfig, decoder: nn.Module) -> dict[str, str]:
    """diffusers name -> file name of every decoder tensor, checked (names and shapes, from
    the header only) against ``decoder``."""
    with open_safetensors(path) as f:
        keys = list(f.keys())  # noqa: SIM118
        renamed, refused = {}, []
        for key in keys:
            try:
                name = oobleck_name(key, len(cfg.c_mults))
            except ValueError:
                refused.append(key)
                continue
            if name is not None and name.startswith("decoder."):
                renamed[name.removeprefix("decoder.")] = key
        if refused:
            raise ValueError(f"{path}: unexpected tensors: {', '.join(refused)}")
        shapes = {n: tuple(f.get_slice(k).get_shape()) for n, k in renamed.items()}
        expected = {
            n: (v.shape[1],) if n.rsplit(".", 1)[-1] in ("alpha", "beta") else tuple(v.shape)
            for n, v in decoder.state_dict().items()
        }
        check_tensors(shapes, expected, f"{path} (decoder, diffusers names)", renamed)
        return renamed


class OobleckAudioDecoder:
    """`headmoe.pipeline.interfaces.AudioDecoder` over diffusers' `OobleckDecoder`.

    ``decode_51200(latents [T, 64]) -> [2, 2048 T]`` (model dtype -> float32, unclamped);
    ``decode(latents, num_samples) -> [2, num_samples]`` float32 at 44.1 kHz in [-1, 1]
    (resampled 441/512, clamped as a 16-bit WAV would, then cut to ``num_samples``)."""

    sample_rate = OUTPUT_SAMPLE_RATE  # after the 441/512 resampling
    tokens_per_second = LATENT_FPS

    def __init__(self, decoder: nn.Module, config: OobleckConfig):
        self.decoder, self.config = decoder, config
        self.latent_channels, self.channels = config.latent_dim, config.out_channels

    def latent_length(self, duration_s: float) -> int:
        """`audio_latent_length`."""
        return audio_latent_length(duration_s)

    @torch.no_grad()
    def decode_51200(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() != 2 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"audio latents must be [T, {self.latent_channels}], got {list(latents.shape)}"
            )
        p = next(self.decoder.parameters())
        out = self.decoder(latents.T.unsqueeze(0).to(device=p.device, dtype=p.dtype))
        return out[0].float().cpu()

    def decode(self, latents: torch.Tensor, num_samples: int) -> torch.Tensor:
        wave = resample_51200_to_44100(self.decode_51200(latents))
        if num_samples > wave.shape[-1]:
            raise ValueError(f"num_samples={num_samples} > {wave.shape[-1]} decoded samples")
        return wave[:, :num_samples].clamp(-1.0, 1.0)


def folder_config(folder: str | os.PathLike) -> tuple[OobleckConfig, str]:
    """The decoder configuration of a stable-audio folder and its weights file's path."""
    folder = os.fspath(folder)
    cfg_path, path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    for p in (cfg_path, path):
        if not os.path.isfile(p):
            raise ValueError(f"stable-audio folder {folder!r}: missing {os.path.basename(p)}")
    return OobleckConfig.from_model_config(read_json(cfg_path, "stable-audio config"),
                                           cfg_path), path


#: the decoder configuration keys headmoe reads (`OobleckConfig.from_model_config`)
DECODER_KEYS = frozenset({"channels", "c_mults", "strides", "latent_dim", "out_channels",
                          "use_snake", "final_tanh"})


def unused_entries(folder: str | os.PathLike) -> list[str]:
    """``"<file>: <keys>"`` when the decoder configuration of ``model_config.json`` has keys
    headmoe does not use (warned about and recorded, not refused)."""
    data = read_json(os.path.join(os.fspath(folder), CONFIG_FILE), "stable-audio config")
    cfg = data["model"]["pretransform"]["config"]["decoder"]["config"]
    unused = sorted(k for k in cfg if k not in DECODER_KEYS)
    return [f"{CONFIG_FILE} decoder config: {', '.join(unused)}"] if unused else []


def check_oobleck_decoder(folder: str | os.PathLike) -> OobleckConfig:
    """Check a ``stable-audio-open-1.0/`` folder as `load_oobleck_decoder` would, reading
    only ``model_config.json`` and the safetensors header; returns the decoder
    configuration. Raises `ValueError` naming the file or tensors."""
    cfg, path = folder_config(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm
        _decoder_names(path, cfg, cfg.build("meta"))
    return cfg


def load_oobleck_decoder(
    folder: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fold_weight_norm: bool = True,
) -> OobleckAudioDecoder:
    """The decoder of the release's ``stable-audio-open-1.0/`` folder (``model_config.json``
    + ``model.safetensors`` in the stable-audio-tools layout). Only the 182 decoder tensors
    are read; encoder, DiT and conditioner tensors are skipped by name, anything else is
    refused. With ``fold_weight_norm`` the weight-norm pairs become plain weights after
    loading (same output)."""
    cfg, path = folder_config(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm
        decoder = cfg.build("meta")
        state = _read_decoder(path, cfg, decoder)
        state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        decoder.load_state_dict(state, strict=True, assign=True)
        if fold_weight_norm:
            for m in decoder.modules():
                if hasattr(m, "weight_g"):
                    torch.nn.utils.remove_weight_norm(m)
    return OobleckAudioDecoder(decoder.eval(), cfg)


def stable_audio_name(name: str, n_blocks: int = 5) -> str:
    """Inverse of `oobleck_name` for the decoder: a diffusers ``OobleckDecoder`` name (no
    ``decoder.`` prefix) -> the stable-audio-tools file name."""
    parts = name.split(".")
    ends = {"conv1": 0, "snake1": n_blocks + 1, "conv2": n_blocks + 2}
    if parts[0] in ends and len(parts) == 2:
        return f"{DECODER_PREFIX}layers.{ends[parts[0]]}.{parts[1]}"
    if parts[0] == "block" and len(parts) >= 4:
        outer = f"{DECODER_PREFIX}layers.{int(parts[1]) + 1}.layers"
        sub, rest = parts[2], parts[3:]
        if sub in ("snake1", "conv_t1") and len(rest) == 1:
            return f"{outer}.{0 if sub == 'snake1' else 1}.{rest[0]}"
        if sub.startswith("res_unit") and len(rest) == 2 and rest[0] in RES_UNIT:
            unit = int(sub.removeprefix("res_unit")) + 1
            return f"{outer}.{unit}.layers.{RES_UNIT.index(rest[0])}.{rest[1]}"
    raise ValueError(f"OobleckDecoder tensor {name!r}: unknown layout")


def build_tiny_audio_vae(folder: str | os.PathLike, seed: int = 1003, channels: int = 8) -> str:
    """Write a tiny random Oobleck decoder as a stable-audio-tools folder
    (``model_config.json`` + ``model.safetensors`` with ``pretransform.model.decoder.*``
    only) that `load_oobleck_decoder` reads like the release's. Deterministic; returns the
    folder. Weight norm: ``weight_v`` ~ N(0, 1), ``weight_g`` 1 (0.3 for each residual
    unit's 1x1 conv, 0.5 for the last conv), snake log-parameters N(0, 0.3^2), biases
    N(0, 0.02^2)."""
    folder = os.fspath(folder)
    cfg = OobleckConfig(channels=channels)
    gen = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        spec = {k: tuple(v.shape) for k, v in cfg.build("meta").state_dict().items()}
    tensors = {}
    for name, shape in spec.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "weight_v":
            value = torch.randn(shape, generator=gen)
        elif leaf == "weight_g":
            gain = 0.3 if ".res_unit" in name and ".conv2." in name else 1.0
            value = torch.full(shape, 0.5 if name.startswith("conv2.") else gain)
        elif leaf in ("alpha", "beta"):
            value = 0.3 * torch.randn(shape[1], generator=gen)
        else:
            value = 0.02 * torch.randn(shape, generator=gen)
        tensors[stable_audio_name(name, len(cfg.c_mults))] = value.contiguous()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE))
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(_model_config(cfg), f, indent=1)
    return folder


def _model_config(cfg: OobleckConfig) -> dict:
    """A stable-audio-tools ``model_config.json`` skeleton with ``cfg``'s decoder."""
    coder = {"c_mults": list(cfg.c_mults), "strides": list(cfg.strides), "use_snake": True}
    decoder = {"out_channels": cfg.out_channels, "channels": cfg.channels, **coder}
    decoder.update(latent_dim=cfg.latent_dim, final_tanh=False)
    return {
        "model_type": "diffusion_cond",
        "sample_rate": cfg.sample_rate,
        "audio_channels": cfg.out_channels,
        "model": {
            "pretransform": {
                "type": "autoencoder",
                "config": {
                    "decoder": {"type": "oobleck", "config": decoder},
                    "bottleneck": {"type": "vae"},
                    "latent_dim": cfg.latent_dim,
                    "downsampling_ratio": cfg.hop,
                    "io_channels": cfg.out_channels,
                },
            }
        },
    }
