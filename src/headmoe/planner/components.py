"""Device bytes of the release's text encoder and decoders, and where they sit per rank.

Sizes are parameter + buffer bytes of each component as headmoe loads it, counted on the
meta device (no memory): the text encoder's first ``L - 2`` decoder layers and embedding in
its model dtype (`text_encoder.model_dtype`); the video decoder in bf16 (TurboV3, or the
whole Wan2.2 ``AutoencoderKLWan``, encoder included, as `load_wan_vae` builds it); the
Oobleck decoder in fp32 with its weight norm folded (`headmoe.release.placement`).
Sources: a release folder (its own configs), or a preset: "tiny" (the embedded tiny
folder's `TINY_SPEC`) or "magi2-preview" (released decoder configs; for the text encoder
`PREVIEW_TEXT_CONFIG`, our reading of the published Qwen3.5-27B sizes, which a folder's
``text_encoder/config.json`` replaces).

Placement (`component_bytes_per_rank`): the text encoder on every node's first rank, the
decoders on every output rank (a DP group's rank with SP and CFG coordinates 0), the
image-to-video encoder (the Wan2.2 VAE's encoder half, fp32) on rank 0; with ``offload``
none of them stays on the device between uses.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import cache

import torch

from headmoe.distributed.topology import Topology, is_output_coords
from headmoe.release import audio_vae, text_encoder, tiny_text_encoder, turbo_vae, wan_vae
from headmoe.release import folder as release
from headmoe.release.placement import IMAGE_RANK

#: Qwen3.5-27B text model sizes used when no release folder is given (MAGI2.md section 7:
#: 5120-d features); the folder's config.json is the authority when there is one
PREVIEW_TEXT_CONFIG = {
    "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "linear_num_value_heads": 48, "linear_num_key_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}


@dataclass(frozen=True)
class ComponentBytes:
    """Device bytes of each component as loaded (see the module doc)."""

    text_encoder: int
    video_decoder: int
    audio_decoder: int
    image_encoder: int = 0
    """Image-to-video: the Wan2.2 encoder half (fp32), on rank 0 only (0: no image)."""

    @property
    def decoders(self) -> int:
        return self.video_decoder + self.audio_decoder


def _nbytes(module: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    size = (lambda t: dtype.itemsize) if dtype is not None else (lambda t: t.element_size())
    return sum(t.numel() * size(t) for t in [*module.parameters(), *module.buffers()])


def _text_bytes(cfg, dtype: torch.dtype) -> int:
    """The first L - 2 layers and the embedding (no final norm), in ``dtype``."""
    from transformers import Qwen3_5TextModel

    with torch.device("meta"):
        model = Qwen3_5TextModel(cfg)
    dropped = [*model.layers[-2:], model.norm]
    return _nbytes(model, dtype) - sum(_nbytes(m, dtype) for m in dropped)


def _text_config(source: str):
    from transformers import Qwen3_5TextConfig

    if source == "tiny":
        t = release.TINY_SPEC["text_encoder"]
        vocab = len(tiny_text_encoder.train_tokenizer())
        return tiny_text_encoder.tiny_config(vocab, t["hidden_size"], t["layers"]), torch.float32
    if source == "magi2-preview":
        layers = PREVIEW_TEXT_CONFIG["num_hidden_layers"]
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        return Qwen3_5TextConfig(**PREVIEW_TEXT_CONFIG, layer_types=types), torch.bfloat16
    folder = os.path.join(source, release.TEXT_ENCODER_DIR)
    return text_encoder._text_config(folder), text_encoder.model_dtype(folder)


def _video_bytes(source: str, video_decoder: str) -> int:
    if video_decoder == "turbo":
        if source in ("tiny", "magi2-preview"):
            widths = release.TINY_SPEC["turbo_vae"]["widths"] if source == "tiny" else None
            cfg = turbo_vae.TurboVAEConfig(
                **({"decoder_block_out_channels": tuple(widths)} if widths else {}))
        else:
            cfg = turbo_vae.TurboVAEConfig.from_json(
                os.path.join(source, release.TURBO_DIR, turbo_vae.CONFIG_FILE))
        return _nbytes(turbo_vae.build_turbo_vae(cfg), torch.bfloat16)
    return _nbytes(wan_vae.build_wan_vae(_wan_config(source)), torch.bfloat16)


def _wan_config(source: str) -> dict | None:
    """The ``AutoencoderKLWan`` config of ``source``'s ``vae/`` (None: the released one)."""
    if source == "tiny":
        v = release.TINY_SPEC["vae"]
        return dict(wan_vae.RELEASED_CONFIG, base_dim=v["base_dim"],
                    decoder_base_dim=v["decoder_base_dim"])
    if source == "magi2-preview":
        return None
    path = os.path.join(source, release.WAN_DIR, wan_vae.CHECKPOINT_FILE)
    return wan_vae.config_for(wan_vae.read_tensors(path), path)


def _image_encoder_bytes(source: str) -> int:
    """The encoder and ``quant_conv`` of the Wan2.2 VAE in fp32, as `load_wan_encoder`."""
    vae = wan_vae.build_wan_vae(_wan_config(source))
    return sum(_nbytes(getattr(vae, p.rstrip(".")), torch.float32)
               for p in wan_vae.ENCODER_PARTS)


def _audio_bytes(source: str) -> int:
    if source == "tiny":
        cfg = audio_vae.OobleckConfig(channels=release.TINY_SPEC["audio"]["channels"])
    elif source == "magi2-preview":
        cfg = audio_vae.OobleckConfig()
    else:
        cfg, _ = audio_vae.folder_config(os.path.join(source, release.AUDIO_DIR))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = cfg.build("meta")
    folded = sum(t.numel() for n, t in model.named_parameters() if n.endswith(".weight_g"))
    return _nbytes(model, torch.float32) - 4 * folded  # weight norm folded after loading


@cache
def component_bytes(source: str, video_decoder: str = "turbo",
                    image: bool = False) -> ComponentBytes:
    """`ComponentBytes` for ``source``: "tiny", "magi2-preview" or a release folder path
    (``image``: with the image-to-video encoder)."""
    cfg, dtype = _text_config(source)
    return ComponentBytes(_text_bytes(cfg, dtype), _video_bytes(source, video_decoder),
                          _audio_bytes(source), _image_encoder_bytes(source) if image else 0)


def component_bytes_per_rank(topo: Topology, parts: ComponentBytes, ranks_per_node: int,
                             offload: bool = False) -> tuple[int, ...]:
    """Device bytes of the components on each rank of ``topo`` (see the module doc)."""
    if ranks_per_node < 1 or topo.world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world of "
                         f"{topo.world_size} ranks")
    out = []
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        held = parts.text_encoder if rank % ranks_per_node == 0 else 0
        held += parts.decoders if is_output_coords(c) else 0
        held += parts.image_encoder if rank == IMAGE_RANK else 0
        out.append(0 if offload else held)
    return tuple(out)
