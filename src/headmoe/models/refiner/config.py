"""MAGI-2 refiner configuration: presets, the released schema, parallel checks.

`magi2-refiner` is the released 1080p refiner (golden/magi2_refiner/README.md:
30 layers, C 4096, head_dim 128, 32 query / 8 KV heads, modality-specific layers 0, 1, 28,
29, MLP width 10920, block-grid attention over 8x4x4 blocks with radius 2 in every layer).
`Magi2RefinerConfig.from_dict` reads our own `to_dict()` output or the upstream model
section (the `arch` object of golden/magi2_refiner/config.json).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TypedDict, cast

from headmoe.config import ParallelConfig, check_positive_int, is_int
from headmoe.models.magi2.config import PARAMS_DTYPES, TransformerShape, config_from_json


@dataclass(frozen=True)
class Magi2RefinerConfig(TransformerShape):
    """Dimensions of a MAGI-2 refiner (validated on construction).

    Derived sizes (REFINER.md section 2): query heads `hidden_size // head_dim`, rotary
    bands `head_dim // 8`, MLP width `floor(C * 4 * 2/3)` rounded down to a multiple of 4.
    Attention: video token (t, h, w) lies in block (t // block_t, h // block_h,
    w // block_w); two video tokens see each other iff their blocks differ by at most
    `radius_*` on every axis; every pair with a text (or audio) token is visible."""

    name: str
    num_layers: int
    multimodal_layers: tuple[int, ...]
    """Layers with three weight sets (video, audio, text) stacked along the output dim."""
    hidden_size: int
    head_dim: int
    num_query_groups: int
    """KV heads (GQA); must divide the query heads."""
    video_in_channels: int = 48
    audio_in_channels: int = 64
    text_in_channels: int = 5120
    params_dtype: str = "bfloat16"
    norm_eps: float = 1e-6
    block_t: int = 8
    block_h: int = 4
    block_w: int = 4
    radius_t: int = 2
    radius_h: int = 2
    radius_w: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type == "int":
                check_positive_int(f.name, getattr(self, f.name))
        for radius in ("radius_t", "radius_h", "radius_w"):
            v = getattr(self, radius)
            if not is_int(v) or v < 0:
                raise ValueError(f"{radius} must be an int >= 0, got {v!r}")
        layers = self.multimodal_layers
        if not isinstance(layers, tuple) or any(
            not is_int(i) or not 0 <= i < self.num_layers for i in layers
        ) or len(set(layers)) != len(layers):
            raise ValueError(f"multimodal_layers must be a tuple of distinct layer ids in "
                             f"[0, {self.num_layers}), got {layers!r}")
        if self.hidden_size % self.head_dim:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by "
                             f"head_dim={self.head_dim}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be divisible "
                             f"by num_query_groups={self.num_query_groups}")
        if self.head_dim % 8:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 8 (rotary bands)")
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype must be one of {sorted(PARAMS_DTYPES)}, "
                             f"got {self.params_dtype!r}")

    @property
    def intermediate_size(self) -> int:
        """floor(C * 4 * 2/3) rounded down to a multiple of 4 (10920 for C = 4096)."""
        return int(self.hidden_size * 4 * 2 / 3) // 4 * 4

    @property
    def block_size(self) -> tuple[int, int, int]:
        return (self.block_t, self.block_h, self.block_w)

    @property
    def radius(self) -> tuple[int, int, int]:
        return (self.radius_t, self.radius_h, self.radius_w)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["multimodal_layers"] = list(self.multimodal_layers)
        return out

    @classmethod
    def from_dict(cls, data: object, name: str = "custom") -> Magi2RefinerConfig:
        """A config from `to_dict()`'s output, the upstream model section (keys
        `mm_layers`, `num_heads_q`, ...) or SandAI's nested form (``arch`` / ``data_proxy`` /
        ``evaluation``, as golden/magi2_refiner/config.json), whose data-proxy and
        evaluation fields must be the released refiner's (`RELEASED_DATA_PROXY`,
        `RELEASED_EVALUATION`). Raises `ValueError` naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"refiner config must be a JSON object, got {type(data).__name__}")
        if "arch" in data:
            return _from_nested(data, name)
        if "mm_layers" in data:
            return _from_upstream(data, name)
        own = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - own)
        if unknown:
            raise ValueError(f"refiner config has unknown fields: {', '.join(unknown)}")
        kwargs = {"name": name, **data}
        kwargs["multimodal_layers"] = tuple(kwargs.get("multimodal_layers", ()))
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"refiner config: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Magi2RefinerConfig:
        """`from_dict` of a JSON file; errors name the file."""
        return config_from_json(cls.from_dict, path, "refiner config")


#: upstream field -> value the released refiner has (anything else is refused)
_UPSTREAM_FIXED = {
    "enable_attn_gating": True, "activation_type": "swiglu7", "layer_activation_types": {},
    "post_norm_layers": [],
}
_UPSTREAM_FIELDS = {
    "num_layers", "hidden_size", "head_dim", "num_query_groups", "video_in_channels",
    "audio_in_channels", "text_in_channels", "params_dtype", "mm_layers", "local_attn_layers",
    "checkpoint_qk_layernorm_rope", "num_heads_q", "num_heads_kv", *_UPSTREAM_FIXED,
}


def _from_upstream(data: dict[str, object], name: str) -> Magi2RefinerConfig:
    unknown = sorted(set(data) - _UPSTREAM_FIELDS)
    if unknown:
        raise ValueError(f"refiner config has unknown fields: {', '.join(unknown)}")
    for key, fixed in _UPSTREAM_FIXED.items():
        if key in data and data[key] != fixed:
            raise ValueError(f"refiner config field {key}={data[key]!r} is not supported "
                             f"(the released refiner has {fixed!r})")
    n = data.get("num_layers")
    local = data.get("local_attn_layers")
    if local is not None and is_int(n) and list(cast(Iterable[object], local)) != list(range(n)):
        raise ValueError(f"refiner config field local_attn_layers={local!r} is not supported "
                         f"(every layer uses the block-grid attention)")
    dtype = str(data.get("params_dtype", "bfloat16")).removeprefix("torch.")
    kwargs = {k: data[k] for k in ("num_layers", "hidden_size", "head_dim", "num_query_groups",
                                   "video_in_channels", "audio_in_channels", "text_in_channels")
              if k in data}
    try:
        layers = tuple(cast(Iterable[int], data["mm_layers"]))
        # JSON values; __post_init__ checks them
        cfg = Magi2RefinerConfig(name=name, multimodal_layers=layers,
                                 params_dtype=dtype, **kwargs)  # type: ignore[arg-type]
    except TypeError as e:
        raise ValueError(f"refiner config: {e}") from None
    for key, want in (("num_heads_q", cfg.num_attention_heads),
                      ("num_heads_kv", cfg.num_query_groups)):
        if key in data and data[key] != want:
            raise ValueError(f"refiner config field {key}={data[key]!r} must be {want}")
    return cfg


#: the released refiner's evaluation fields (golden/magi2_refiner/config.json, REFINER.md
#: section 2): its steps, shift, text guidance and re-noise index; `headmoe.pipeline.refine`
#: runs them. A nested config must have these values; its other evaluation fields (the
#: preview's recipe, the audio guidance the refiner does not use) are read and not used.
class ReleasedEvaluation(TypedDict):
    """The keys and value types of `RELEASED_EVALUATION`."""

    magi2_refiner_num_inference_steps: int
    magi2_refiner_shift: float
    magi2_refiner_video_txt_guidance_scale: float
    magi2_refiner_noise_value: int
    magi2_refiner_vae_stride: list[int]
    magi2_refiner_patch_size: list[int]


RELEASED_EVALUATION: ReleasedEvaluation = {
    "magi2_refiner_num_inference_steps": 5, "magi2_refiner_shift": 5.0,
    "magi2_refiner_video_txt_guidance_scale": 2.0, "magi2_refiner_noise_value": 220,
    "magi2_refiner_vae_stride": [4, 16, 16], "magi2_refiner_patch_size": [1, 1, 1],
}
_EVALUATION_UNUSED = {
    "magi2_refiner_audio_txt_guidance_scale", "magi2_refiner_audio_noise_scale",
    "use_cfg_trick", "shift", "fps", "num_inference_steps",
}
#: the released refiner's data-proxy fields: patching, coordinates and the block-grid
#: attention (8 x 4 x 4 blocks, radius 2 on every axis, no full-attention layer)
RELEASED_DATA_PROXY: dict[str, object] = {
    "t_patch_size": 1, "patch_size": 1, "text_offset": 0, "coords_style": "v1",
    "spatial_rope_interpolation": "extra", "magi2_refiner_condition_input": "none",
    "attn_config": {
        "mode": "window", "block_t_size": 8, "block_size": 4,
        "window": {"level": "block", "block_mode": "grid", "block_t_radius": 2,
                   "block_h_radius": 2, "block_w_radius": 2, "full_attn_layers": []},
    },
}
#: data-proxy fields that do not change the released function in block-grid mode
_DATA_PROXY_UNUSED = {"frame_receptive_field", "attn_config.window.win_size",
                      "attn_config.window.frame_receptive_field",
                      "attn_config.window.auto_range_merge", "attn_config.window.sparse_load"}


def _check_section(data: object, released: Mapping[str, object], unused: set[str], path: str) -> None:
    """Every field of ``data`` is a released one with its value, or a known unused one."""
    if not isinstance(data, dict):
        raise ValueError(f"refiner config field {path} must be a JSON object, "
                         f"got {type(data).__name__}")
    prefix = path.split(".", 1)[1] + "." if "." in path else ""
    for key, value in data.items():
        full = prefix + key
        if full in unused:
            continue
        if key not in released:
            raise ValueError(f"refiner config has unknown field {path}.{key}")
        want = released[key]
        if isinstance(want, dict):
            _check_section(value, want, unused, f"{path}.{key}")
        elif value != want or type(value) is bool:
            raise ValueError(f"refiner config field {path}.{key}={value!r} differs from the "
                             f"released refiner's {want!r}")


def _from_nested(data: dict[str, object], name: str) -> Magi2RefinerConfig:
    unknown = sorted(set(data) - {"arch", "data_proxy", "evaluation"})
    if unknown:
        raise ValueError(f"refiner config has unknown fields: {', '.join(unknown)}")
    if not isinstance(data["arch"], dict):
        raise ValueError(f"refiner config field arch must be a JSON object, "
                         f"got {type(data['arch']).__name__}")
    cfg = _from_upstream(data["arch"], name)
    _check_section(data.get("data_proxy", {}), RELEASED_DATA_PROXY, _DATA_PROXY_UNUSED,
                   "data_proxy")
    _check_section(data.get("evaluation", {}), RELEASED_EVALUATION, _EVALUATION_UNUSED,
                   "evaluation")
    return cfg


PRESETS: dict[str, Magi2RefinerConfig] = {
    "magi2-refiner": Magi2RefinerConfig(
        name="magi2-refiner", num_layers=30, multimodal_layers=(0, 1, 28, 29),
        hidden_size=4096, head_dim=128, num_query_groups=8,
    ),
    # the embedded tiny release's refiner: 8 query / 4 KV heads so that SP 4 holds one KV
    # head per rank, text width of the tiny release's text encoder
    "tiny-refiner": Magi2RefinerConfig(
        name="tiny-refiner", num_layers=4, multimodal_layers=(0, 3), hidden_size=128,
        head_dim=16, num_query_groups=4, text_in_channels=64,
    ),
}


def get_refiner_config(name: str, **overrides: object) -> Magi2RefinerConfig:
    """A preset ("magi2-refiner", "tiny-refiner"), optionally with fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"refiner config name must be one of {sorted(PRESETS)}, got {name!r}")
    # replace() refuses unknown names at run time; __post_init__ checks the values
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]  # type: ignore[arg-type]


def validate_parallel(config: Magi2RefinerConfig, parallel: ParallelConfig) -> None:
    """Check a refiner config against a parallel config (before any collective); raises
    `ValueError` naming the fields and values. EP does not apply (no MoE): the refiner runs
    on the SP groups of the layout and ignores the EP fields."""
    sp = parallel.ulysses_degree
    if config.num_attention_heads % sp:
        raise ValueError(f"refiner num_attention_heads={config.num_attention_heads} must be "
                         f"divisible by ulysses_degree={sp}")
    if parallel.cfg_parallel_size not in (1, 2):
        raise ValueError(f"cfg_parallel_size={parallel.cfg_parallel_size} must be 1 or 2")
