"""MAGI-2 transformer configuration: presets and validation against a ParallelConfig.

All dimensions are plain fields so that planners and memory estimates can read them
without building the model. Numbers of `magi2-preview` are from MAGI-2 Preview's public
release (see /work/shared/design/MAGI2.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from headmoe.config import ParallelConfig, check_positive_int

#: modality ids, in packing order ([video | audio | text]); modality-specific weights are
#: stored modality-major in this order
MODALITIES: tuple[str, ...] = ("video", "audio", "text")
VIDEO, AUDIO, TEXT = 0, 1, 2


@dataclass(frozen=True)
class Magi2Config:
    """Dimensions of a MAGI-2-family transformer (validated on construction)."""

    name: str
    num_layers: int
    dense_layers: tuple[int, ...]
    """Dense "multimodal" layers (modality-specific MLP weights); every other layer is MoE."""
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    video_in_channels: int
    audio_in_channels: int
    text_in_channels: int
    dense_intermediate_size: int
    moe_num_heads: int
    moe_head_dim: int
    moe_num_experts: int
    """Experts per MoE head."""
    moe_top_k: int
    moe_expert_intermediate_size: int
    shared_expert_intermediate_size: int
    moe_route_scale: float = 4.9
    rope_bands: int = 16
    """Frequency bands per rotary axis; 6 * rope_bands head dims are rotated."""
    rope_theta: float = 10000.0
    rope_axis_scales: tuple[float, float, float] = (1.0, 1.0, 1.0)
    time_embed_dim: int = 64
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20
    mhc_eps: float = 1e-12
    norm_eps: float = 1e-6
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type == "int":
                check_positive_int(f.name, getattr(self, f.name))
        layers = self.dense_layers
        if not isinstance(layers, tuple) or any(
            not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers
        ) or len(set(layers)) != len(layers):
            raise ValueError(
                f"dense_layers must be a tuple of distinct layer ids in [0, {self.num_layers}), "
                f"got {layers!r}"
            )
        if self.moe_top_k > self.moe_num_experts:
            raise ValueError(
                f"moe_top_k={self.moe_top_k} exceeds moe_num_experts={self.moe_num_experts}"
            )
        if 6 * self.rope_bands > self.head_dim:
            raise ValueError(
                f"rope_bands={self.rope_bands} rotates {6 * self.rope_bands} dims, more than "
                f"head_dim={self.head_dim}"
            )
        if self.time_embed_dim % 2 or self.time_embed_dim > self.hidden_size:
            raise ValueError(
                f"time_embed_dim={self.time_embed_dim} must be even and at most "
                f"hidden_size={self.hidden_size}"
            )

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.dense_layers))

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def num_modalities(self) -> int:
        return len(MODALITIES)

    @property
    def moe_hidden_size(self) -> int:
        """Width of the MoE layer's input: moe_num_heads * moe_head_dim."""
        return self.moe_num_heads * self.moe_head_dim

    @property
    def attention_width(self) -> int:
        """num_attention_heads * head_dim (q, k and v each)."""
        return self.num_attention_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS: dict[str, Magi2Config] = {
    "magi2-preview": Magi2Config(
        name="magi2-preview", num_layers=40, dense_layers=(0, 1, 38, 39), hidden_size=3072,
        num_attention_heads=24, head_dim=128, video_in_channels=48, audio_in_channels=64,
        text_in_channels=5120, dense_intermediate_size=8192, moe_num_heads=12,
        moe_head_dim=256, moe_num_experts=256, moe_top_k=6, moe_expert_intermediate_size=1280,
        shared_expert_intermediate_size=1280, rope_bands=16,
    ),
    "tiny": Magi2Config(
        name="tiny", num_layers=6, dense_layers=(0, 1, 4, 5), hidden_size=384,
        num_attention_heads=24, head_dim=16, video_in_channels=48, audio_in_channels=64,
        text_in_channels=5120, dense_intermediate_size=1024, moe_num_heads=12,
        moe_head_dim=32, moe_num_experts=8, moe_top_k=2, moe_expert_intermediate_size=64,
        shared_expert_intermediate_size=64, rope_bands=2,
    ),
}


def get_config(name: str, **overrides: Any) -> Magi2Config:
    """A preset ("tiny", "magi2-preview"), optionally with fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"model config name must be one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


def validate_parallel(config: Magi2Config, parallel: ParallelConfig) -> None:
    """Check a model config against a parallel config (pure arithmetic, before any
    collective); raises `ValueError` naming the fields and values."""
    parallel.validate_for_style("head")
    sp = parallel.ulysses_degree
    if config.num_attention_heads % sp:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be divisible by "
            f"ulysses_degree={sp}"
        )
    if parallel.tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={parallel.tensor_parallel_size} is not supported by the "
            "MAGI-2 transformer (must be 1)"
        )
    if parallel.cfg_parallel_size not in (1, 2):
        raise ValueError(
            f"cfg_parallel_size={parallel.cfg_parallel_size} must be 1 or 2 (two CFG branches)"
        )
