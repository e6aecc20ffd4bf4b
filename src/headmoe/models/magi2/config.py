"""MAGI-2 transformer configuration: presets, the released JSON schema, parallel checks.

All dimensions are plain fields so that planners and memory estimates can read them
without building the model. `magi2-preview` is the released configuration of MAGI-2
Preview (its published config.json, golden/magi2/config.json); `Magi2Config.from_dict` reads a model
configuration in the public schema (the one of golden/magi2/config.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, fields, replace
from typing import TypeVar, cast

import torch

from headmoe.config import DTYPES, ParallelConfig, check_positive_int, is_int, is_number
from headmoe.files import brief

#: modality ids, in packing order ([video | audio | text]); modality-specific weights are
#: stored modality-major in this order
MODALITIES: tuple[str, ...] = ("video", "audio", "text")
VIDEO, AUDIO, TEXT = 0, 1, 2

#: `params_dtype` names of the public schema -> torch dtypes (the dtype of the linears and
#: experts; everything else is fp32)
PARAMS_DTYPES: dict[str, torch.dtype] = {"float32": DTYPES["fp32"], "bfloat16": DTYPES["bf16"]}


class TransformerShape:
    """Sizes derived alike for the MAGI-2 transformer and its refiner from their fields
    `hidden_size`, `head_dim`, `num_query_groups`, the three in-channel counts and
    `params_dtype`."""

    hidden_size: int
    head_dim: int
    num_query_groups: int
    video_in_channels: int
    audio_in_channels: int
    text_in_channels: int
    params_dtype: str
    norm_eps: float

    @property
    def num_attention_heads(self) -> int:
        """Query heads: hidden_size // head_dim."""
        return self.hidden_size // self.head_dim

    @property
    def rope_bands(self) -> int:
        """Rotary frequency bands B per axis (head_dim // 8): 3 axes x (sin, cos) x B = 6B,
        so the first 3/4 of each head are rotated."""
        return self.head_dim // 8

    @property
    def qkv_width(self) -> int:
        """Rows of linear_qkv per modality: (query heads + 2 KV heads) * head_dim."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    @property
    def max_in_channels(self) -> int:
        """Width of the packed input x (the largest in-channel count)."""
        return max(self.video_in_channels, self.audio_in_channels, self.text_in_channels)

    @property
    def torch_params_dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.params_dtype]

    @property
    def num_modalities(self) -> int:
        return len(MODALITIES)


@dataclass(frozen=True)
class Magi2Config(TransformerShape):
    """Dimensions of a MAGI-2-family transformer (validated on construction).

    Derived sizes (MAGI2.md section 1): query heads `hidden_size // head_dim`, rotary bands
    `head_dim // 8`, dense intermediate `floor(hidden_size * intermediate_factor * 2/3)`
    rounded down to a multiple of 128 (at least 128), MoE head width
    `hidden_size // moe_num_heads`, mHC width `mhc_streams * hidden_size`."""

    name: str
    num_layers: int
    multimodal_layers: tuple[int, ...]
    """Layers with three weight sets (one per modality) for attention, the dense MLP and
    mhc_norm; every other layer has an MoE MLP and shared attention weights."""
    hidden_size: int
    head_dim: int
    num_query_groups: int
    """KV heads (GQA); must divide the query heads."""
    video_in_channels: int
    audio_in_channels: int
    text_in_channels: int
    moe_num_heads: int
    moe_num_experts: int
    """Experts per MoE head."""
    moe_top_k: int
    moe_expert_intermediate_size: int
    shared_expert_intermediate_size: int
    modality_shared_expert_intermediate_size: int
    intermediate_factor: float = 4.0
    moe_route_scale: float = 4.9
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20
    mhc_eps: float = 1e-12
    params_dtype: str = "bfloat16"
    """Dtype of the released linears and experts ("bfloat16" or "float32")."""
    norm_eps: float = 1e-6
    time_embed_dim: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type == "int":
                check_positive_int(f.name, getattr(self, f.name))
        layers = self.multimodal_layers
        if not isinstance(layers, tuple) or any(
            not is_int(i) or not 0 <= i < self.num_layers
            for i in layers
        ) or len(set(layers)) != len(layers):
            raise ValueError(
                f"multimodal_layers must be a tuple of distinct layer ids in "
                f"[0, {self.num_layers}), got {brief(layers)}"
            )
        self._check_divisible("hidden_size", self.hidden_size, "head_dim", self.head_dim)
        self._check_divisible("hidden_size", self.hidden_size, "moe_num_heads", self.moe_num_heads)
        self._check_divisible("num_attention_heads", self.num_attention_heads,
                              "num_query_groups", self.num_query_groups)
        if self.head_dim % 8:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 8 (rotary bands)")
        if self.moe_top_k > self.moe_num_experts:
            raise ValueError(
                f"moe_top_k={self.moe_top_k} exceeds moe_num_experts={self.moe_num_experts}"
            )
        if self.time_embed_dim % 2 or self.time_embed_dim > self.hidden_size:
            raise ValueError(
                f"time_embed_dim={self.time_embed_dim} must be even and at most "
                f"hidden_size={self.hidden_size}"
            )
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(
                f"params_dtype must be one of {sorted(PARAMS_DTYPES)}, got {self.params_dtype!r}"
            )
        factor = self.intermediate_factor
        if not is_number(factor) or factor <= 0:
            raise ValueError(f"intermediate_factor must be a positive number, got {factor!r}")

    @staticmethod
    def _check_divisible(name: str, value: int, by_name: str, by: int) -> None:
        if value % by:
            raise ValueError(f"{name}={value} must be divisible by {by_name}={by}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def dense_intermediate_size(self) -> int:
        """floor(C * factor * 2/3) rounded down to a multiple of 128 (at least 128)."""
        raw = int(self.hidden_size * self.intermediate_factor * 2 / 3)
        return max(128, raw // 128 * 128)

    @property
    def moe_head_dim(self) -> int:
        return self.hidden_size // self.moe_num_heads

    @property
    def moe_hidden_size(self) -> int:
        """Width of the MoE layer's input: moe_num_heads * moe_head_dim = hidden_size."""
        return self.moe_num_heads * self.moe_head_dim

    @property
    def mhc_width(self) -> int:
        """V = mhc_streams * hidden_size, the width of the adapters and of mhc_norm."""
        return self.mhc_streams * self.hidden_size

    @property
    def out_width(self) -> int:
        """Columns of the packed output (the larger of the video / audio channels)."""
        return max(self.video_in_channels, self.audio_in_channels)

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        """The multimodal (dense-MLP) layers, ascending."""
        return tuple(sorted(self.multimodal_layers))

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.multimodal_layers)

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------ public schema
    @classmethod
    def from_dict(cls, data: object, name: str = "custom") -> Magi2Config:
        """A config from the public MAGI-2 schema (golden/magi2/config.json) or
        from `to_dict()`'s output. Raises `ValueError` naming unknown, missing, unsupported
        or inconsistent fields."""
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a JSON object, got {type(data).__name__}")
        if "moe" in data or "mhc" in data:
            return _from_public(data, name)
        own = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - own)
        if unknown:
            raise ValueError(f"model config has unknown fields: {', '.join(unknown)}")
        kwargs = dict(data)
        kwargs["multimodal_layers"] = tuple(kwargs.get("multimodal_layers", ()))
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"model config: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Magi2Config:
        """`from_dict` of a JSON file; errors name the file."""
        return config_from_json(cls.from_dict, path, "model config")


C = TypeVar("C")


def config_from_json(from_dict: Callable[..., C], path: str | os.PathLike[str], what: str) -> C:
    """``from_dict(data, name=<file stem>)`` of the JSON file ``path``; a `ValueError`
    naming ``what`` and the file when it cannot be read or does not fit."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path!r} is not a readable JSON file: {e}") from None
    except RecursionError:
        raise ValueError(f"{what} {path!r} is nested too deeply to be a config") from None
    try:
        return from_dict(data, name=os.path.splitext(os.path.basename(path))[0])
    except ValueError as e:
        raise ValueError(f"{what} {path!r}: {e}") from None


#: public schema: top-level key -> our field (None: checked, then dropped)
_PUBLIC_TOP = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "head_dim": "head_dim",
    "num_query_groups": "num_query_groups", "multimodal_layers": "multimodal_layers",
    "intermediate_factor": "intermediate_factor", "video_in_channels": "video_in_channels",
    "audio_in_channels": "audio_in_channels", "text_in_channels": "text_in_channels",
    "params_dtype": "params_dtype", "attention_gating": None, "attention_sink_tokens": None,
    "attention_softcap": None, "mhc": None, "moe": None,
}
_PUBLIC_MOE = {
    "num_heads": "moe_num_heads", "num_experts": "moe_num_experts", "top_k": "moe_top_k",
    "expert_intermediate_size": "moe_expert_intermediate_size",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "modality_shared_expert_intermediate_size": "modality_shared_expert_intermediate_size",
    "routing_scale": "moe_route_scale", "layers": None, "normalize_routing_weights": None,
    "score_function": None,
}
_PUBLIC_MHC = {
    "num_streams": "mhc_streams", "sinkhorn_iterations": "mhc_sinkhorn_iters",
    "sinkhorn_epsilon": "mhc_eps", "alpha_init": None, "enabled": None,
}
#: fields of the public schema whose value is fixed in the released model
_PUBLIC_FIXED = {
    "attention_gating": True, "attention_sink_tokens": 1, "attention_softcap": -1.0,
    "mhc.enabled": True, "moe.normalize_routing_weights": True, "moe.score_function": "sigmoid",
}


def _take(section: object, keys: dict[str, str | None], where: str,
          out: dict[str, object]) -> None:
    if not isinstance(section, dict):
        raise ValueError(f"{where or 'model config'} must be an object, got {section!r}")
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ValueError(
            f"model config has unknown fields: {', '.join(where + k for k in unknown)}"
        )
    for key, value in section.items():
        fixed = _PUBLIC_FIXED.get(where + key, value)
        if value != fixed:
            raise ValueError(
                f"model config field {where + key}={value!r} is not supported "
                f"(the released model has {fixed!r})"
            )
        field = keys[key]
        if field is not None:
            out[field] = value


def _from_public(data: dict[str, object], name: str) -> Magi2Config:
    out: dict[str, object] = {"name": name}
    _take(data, _PUBLIC_TOP, "", out)
    _take(data.get("moe", {}), _PUBLIC_MOE, "moe.", out)
    _take(data.get("mhc", {}), _PUBLIC_MHC, "mhc.", out)
    required = {f.name for f in fields(Magi2Config) if f.default is MISSING}
    missing = sorted(required - set(out))
    if missing:
        raise ValueError(f"model config is missing fields for: {', '.join(missing)}")
    out["multimodal_layers"] = tuple(cast(Iterable[object], out["multimodal_layers"]))
    cfg = Magi2Config(**out)  # type: ignore[arg-type]  # JSON values; __post_init__ checks them
    moe = cast(dict[str, object], data.get("moe", {}))  # _take checked it is an object
    moe_layers = moe.get("layers")
    if moe_layers is not None and tuple(cast(Iterable[object], moe_layers)) != cfg.moe_layer_ids:
        raise ValueError(
            f"model config field moe.layers={brief(moe_layers)} must be the layers that are "
            f"not multimodal, {brief(cfg.moe_layer_ids)}"
        )
    return cfg


PRESETS: dict[str, Magi2Config] = {
    "magi2-preview": Magi2Config(
        name="magi2-preview", num_layers=40, multimodal_layers=(0, 1, 38, 39),
        hidden_size=3072, head_dim=128, num_query_groups=24, video_in_channels=48,
        audio_in_channels=64, text_in_channels=5120, moe_num_heads=12, moe_num_experts=256,
        moe_top_k=6, moe_expert_intermediate_size=1280, shared_expert_intermediate_size=1280,
        modality_shared_expert_intermediate_size=1280,
    ),
    "tiny": Magi2Config(
        name="tiny", num_layers=6, multimodal_layers=(0, 1, 4, 5), hidden_size=384,
        head_dim=16, num_query_groups=24, video_in_channels=48, audio_in_channels=64,
        text_in_channels=64, moe_num_heads=12, moe_num_experts=8, moe_top_k=2,
        moe_expert_intermediate_size=64, shared_expert_intermediate_size=64,
        modality_shared_expert_intermediate_size=64,
    ),
}


def get_config(name: str, **overrides: object) -> Magi2Config:
    """A preset ("tiny", "magi2-preview"), optionally with fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"model config name must be one of {sorted(PRESETS)}, got {name!r}")
    # replace() refuses unknown names at run time; __post_init__ checks the values
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]  # type: ignore[arg-type]


def config_from_arg(value: str) -> Magi2Config:
    """The config ``--model-config`` names: a preset, or a JSON file (public MAGI-2 schema or
    `Magi2Config.to_dict()`). Raises `ValueError` naming ``model_config`` otherwise."""
    if value in PRESETS:
        return get_config(value)
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ValueError(f"model_config={value!r} is neither a preset "
                         f"({', '.join(sorted(PRESETS))}) nor a JSON file")
    return Magi2Config.from_json(path)


def validate_parallel(config: Magi2Config, parallel: ParallelConfig) -> None:
    """Check a model config against a parallel config (pure arithmetic, before any
    collective); raises `ValueError` naming the fields and values."""
    sp = parallel.ulysses_degree
    if config.num_attention_heads % sp:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be divisible by "
            f"ulysses_degree={sp}"
        )
    if parallel.cfg_parallel_size not in (1, 2):
        raise ValueError(
            f"cfg_parallel_size={parallel.cfg_parallel_size} must be 1 or 2 (two CFG branches)"
        )
