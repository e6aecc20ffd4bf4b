"""The MAGI-2 Preview release folder (Hugging Face ``sand-ai/MAGI-2-preview``) and the
embedded tiny folder in the same layout.

Layout (paths relative to the folder; docs/pipeline.md section 7)::

    preview/config.json                      transformer config, public MAGI-2 schema
    preview/<name>.safetensors.index.json    transformer index (+ its shards next to it);
                                             or one preview/<name>.safetensors
    text_encoder/config.json, tokenizer.json, [tokenizer_config.json],
                 model.safetensors or model.safetensors.index.json (+ shards)
    turbo_vae/TurboV3-Wan22-TinyShallow_7_7.json, checkpoint.ckpt   (--video-decoder turbo)
    vae/Wan2.2_VAE.pth                                            (--video-decoder wan2.2)
    stable-audio-open-1.0/model_config.json, model.safetensors
    refiner/[config.json,] <name>.safetensors.index.json (+ shards) or <name>.safetensors
                                             the 1080p refiner (optional; config.json absent:
                                             the released `magi2-refiner` configuration)

`find_release` checks that every file the run needs exists and is readable (all missing
ones named in one line); `check_release` then checks every header against the configs with
the components' own check functions and `check_checkpoint`, reading no weight. Both run in
the launching process, before any rank starts. `tiny_release` writes the embedded default:
the same layout with tiny random components, once per content spec, atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from headmoe.files import atomic_folder, entry_problem
from headmoe.models.magi2 import (
    Magi2Config,
    check_checkpoint,
    config_from_arg,
    get_config,
    spec_digest,
    write_random_checkpoint,
)
from headmoe.models.magi2.loading import INDEX_SUFFIX
from headmoe.models.refiner import (
    Magi2RefinerConfig,
    check_refiner_checkpoint,
    get_refiner_config,
    refiner_spec,
    write_random_refiner,
)
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT
from headmoe.release import (
    audio_vae,
    text_encoder,
    tiny_text_encoder,
    turbo_vae,
    video_latents,
    wan_vae,
)

PREVIEW_DIR, TEXT_ENCODER_DIR, AUDIO_DIR = "preview", "text_encoder", "stable-audio-open-1.0"
TURBO_DIR, WAN_DIR = "turbo_vae", "vae"
REFINER_DIR = "refiner"
#: the refiner configuration of a release folder whose refiner/ has no config.json
IMPLIED_REFINER_CONFIG = "magi2-refiner"
MODEL_CONFIG = "config.json"
VIDEO_DECODERS: tuple[str, ...] = ("turbo", "wan2.2")
#: folder of each video decoder
VIDEO_DECODER_DIRS = {"turbo": TURBO_DIR, "wan2.2": WAN_DIR}
#: printed whenever the embedded tiny release runs: its weights are random
RANDOM_WEIGHTS_NOTE = ("note: --model tiny is the embedded tiny release with random weights, "
                       "so the video is coloured noise and the audio is noise; pass a MAGI-2 "
                       "release folder with --model PATH for real output")


@dataclass(frozen=True)
class Release:
    """A checked release folder as the ranks use it (picklable: plain strings).

    ``transformer`` is the index (or single safetensors file) under ``preview/``;
    ``model_config`` the `Magi2Config` of ``preview/config.json``; the other paths are
    component folders. ``video_decoder`` is "turbo" or "wan2.2"; ``offload`` keeps the
    encoder and decoders on the host between uses."""

    root: str
    transformer: str
    model_config: Magi2Config
    text_encoder: str
    video_decoder: str
    video_decoder_path: str
    audio_decoder: str
    offload: bool = False
    image_encoder: str | None = None
    """The ``vae/`` folder whose Wan2.2 encoder encodes I2V images (None: no image input)."""
    refiner: str | None = None
    """The refiner checkpoint under ``refiner/`` (None: the folder has no refiner)."""
    refiner_config: Magi2RefinerConfig | None = None
    """Its `Magi2RefinerConfig`."""
    refiner_problem: str | None = None
    """Why the folder's ``refiner/`` is not used (it failed its checks; `check_release`):
    runs without the refiner stage go on, a run that asks for it is refused with this."""
    expert_format: str = DEFAULT_EXPERT_FORMAT
    """The routed experts' format ``preview/`` stores (`headmoe.moe.formats.stored_format`;
    set by `check_release`): "bf16", the release's, or "fp8" (``headmoe quantize``)."""
    unused: tuple[str, ...] = ()
    """Component file entries headmoe does not read (`unused_entries`; set by the caller of
    `check_release`, recorded in the sidecar)."""

    def describe(self) -> dict[str, Any]:
        """What the sidecar records about the folder."""
        return {
            "release": self.root,
            "video_decoder": self.video_decoder,
            "video_decoder_path": self.video_decoder_path,
            "text_encoder": self.text_encoder,
            "audio_decoder": self.audio_decoder,
            "offload": self.offload,
            "image_encoder": self.image_encoder,
            "refiner": self.refiner,
            "expert_format": self.expert_format,
            "unused_entries": list(self.unused),
        }


def unused_entries(release: Release) -> list[str]:
    """Entries of the component files ``release`` uses that headmoe does not read (extra
    keys of the TurboV3 and stable-audio JSON, training-only state of ``checkpoint.ckpt``),
    each ``"<folder>/<file>: <entries>"``. The reference ignores them: headmoe warns and
    records them (`Release.unused`, the sidecar) instead of refusing the folder."""
    out = []
    if release.video_decoder == "turbo":
        out += [f"{TURBO_DIR}/{e}" for e in turbo_vae.unused_entries(release.video_decoder_path)]
    out += [f"{AUDIO_DIR}/{e}" for e in audio_vae.unused_entries(release.audio_decoder)]
    return out


def is_release_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder (a release folder, checked by `find_release`)."""
    return Path(path).expanduser().is_dir()


def transformer_file(root: Path, folder_name: str = PREVIEW_DIR) -> str | None:
    """The checkpoint under ``folder_name``/ (preview/ or refiner/): its one
    ``*.safetensors.index.json``, else its one ``*.safetensors`` file, else None. Several
    indexes are refused."""
    folder = root / folder_name
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        names = ", ".join(p.name for p in indexes)
        raise ValueError(f"release folder {str(root)!r}: {folder_name}/ holds several indexes "
                         f"({names}); keep one")
    if indexes:
        return str(indexes[0])
    singles = sorted(folder.glob("*.safetensors"))
    return str(singles[0]) if len(singles) == 1 else None


def required_files(video_decoder: str) -> list[str]:
    """Files (relative paths) a run with ``video_decoder`` needs, besides the transformer
    weights and the text encoder's weights (`find_release` looks those up)."""
    if video_decoder not in VIDEO_DECODERS:
        raise ValueError(f"video_decoder must be one of {VIDEO_DECODERS}, got {video_decoder!r}")

    video = (
        [f"{TURBO_DIR}/{turbo_vae.CONFIG_FILE}", f"{TURBO_DIR}/{turbo_vae.CHECKPOINT_FILE}"]
        if video_decoder == "turbo"
        else [f"{WAN_DIR}/{wan_vae.CHECKPOINT_FILE}"]
    )
    text = [f"{TEXT_ENCODER_DIR}/{n}" for n in ("config.json", "tokenizer.json")]
    audio = [f"{AUDIO_DIR}/{audio_vae.CONFIG_FILE}", f"{AUDIO_DIR}/{audio_vae.WEIGHTS_FILE}"]
    return [*text, *video, *audio]


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read (None when it can: it opens and yields a first byte)."""
    try:
        with open(path, "rb") as f:
            if not f.read(1):
                return "empty"
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


#: files read when present (the published release has neither)
OPTIONAL_FILES = (f"{PREVIEW_DIR}/{MODEL_CONFIG}", f"{TEXT_ENCODER_DIR}/tokenizer_config.json")
#: the configuration of a release folder without preview/config.json (the published
#: release has none: every public loader hard-codes it, MAGI2.md section 7)
IMPLIED_CONFIG = "magi2-preview"


def release_config(base: Path, model_config: Magi2Config | str | None = None) -> Magi2Config:
    """The transformer configuration of release folder ``base``: ``model_config`` when given
    (a `Magi2Config`, a preset name or a JSON file), else ``preview/config.json`` when
    present, else the `IMPLIED_CONFIG` preset; named after the folder."""
    if isinstance(model_config, str):
        cfg = config_from_arg(model_config)
    elif model_config is not None:
        cfg = model_config
    elif (base / PREVIEW_DIR / MODEL_CONFIG).is_file():
        cfg = Magi2Config.from_json(base / PREVIEW_DIR / MODEL_CONFIG)
    else:
        return get_config(IMPLIED_CONFIG)
    return dataclasses.replace(cfg, name=base.name)


def find_refiner(base: Path) -> tuple[str | None, Magi2RefinerConfig | None]:
    """(checkpoint, `Magi2RefinerConfig`) of ``base/refiner/``, or (None, None) when the
    folder has no refiner checkpoint. The config is ``refiner/config.json`` when present,
    else the `IMPLIED_REFINER_CONFIG` preset. The checkpoint and the config are held to the
    rule of every component file (`entry_problem`: inside the folder, a regular file,
    readable): a ``refiner/`` linked out of the folder, or a config.json that is a FIFO, a
    device or a folder, is refused with one `ValueError`, never replaced by the preset."""
    if not (base / REFINER_DIR).is_dir():
        return None, None
    checkpoint = transformer_file(base, REFINER_DIR)
    if checkpoint is None:
        return None, None
    cfg_rel = f"{REFINER_DIR}/{MODEL_CONFIG}"
    given = os.path.lexists(base / cfg_rel)
    problems = []
    for rel in [os.path.relpath(checkpoint, base), *([cfg_rel] if given else [])]:
        why, real = entry_problem(base, rel)
        if why := why or _unreadable(Path(real)):
            problems.append(f"{rel} ({why})")
    if problems:
        raise ValueError(f"release folder {str(base)!r}: " + ", ".join(problems))
    if given:
        return checkpoint, Magi2RefinerConfig.from_json(base / cfg_rel)
    return checkpoint, get_refiner_config(IMPLIED_REFINER_CONFIG)


def find_release(
    root: str | os.PathLike, video_decoder: str = "turbo", offload: bool = False,
    image_encoder: bool | None = False, model_config: Magi2Config | str | None = None,
) -> Release:
    """The `Release` of folder ``root``: every file `required_files` lists, the transformer
    under ``preview/`` and the text encoder's weights must exist and be readable; all that
    do not are named (relative to ``root``) in one `ValueError`. The configuration is
    `release_config`'s; headers are checked by `check_release`. ``image_encoder``: True
    requires ``vae/Wan2.2_VAE.pth`` (image-to-video), None uses it when present (a server),
    False leaves it out."""
    base = Path(root).expanduser()
    if not base.is_dir():
        raise ValueError(f"model={str(root)!r} is not a release folder")
    files = required_files(video_decoder)
    files += [rel for rel in OPTIONAL_FILES if os.path.lexists(base / rel)]  # checked alike
    vae = f"{WAN_DIR}/{_wan_file()}"
    if image_encoder and vae not in files:
        files.append(vae)
    transformer = transformer_file(base)
    index = base / TEXT_ENCODER_DIR / f"model{INDEX_SUFFIX}"  # else the single file
    files.append(f"{TEXT_ENCODER_DIR}/" + (index.name if index.exists() else "model.safetensors"))
    problems = [] if transformer else [f"{PREVIEW_DIR}/*{INDEX_SUFFIX} (missing)"]
    for rel in ([str(Path(transformer).relative_to(base))] if transformer else []) + files:
        why, real = entry_problem(base, rel)  # confined to the folder, never a FIFO
        why = why or _unreadable(Path(real))
        if why:
            problems.append(f"{rel} ({why})")
    if problems:
        raise ValueError(f"release folder {str(base)!r}: " + ", ".join(problems))
    try:
        refiner, refiner_config, refiner_problem = *find_refiner(base), None
    except ValueError as e:  # only a run that uses the refiner needs it (check_release)
        refiner, refiner_config, refiner_problem = None, None, " ".join(str(e).split())
    return Release(
        root=str(base),
        transformer=str(transformer),
        model_config=release_config(base, model_config),
        text_encoder=str(base / TEXT_ENCODER_DIR),
        video_decoder=video_decoder,
        video_decoder_path=str(base / VIDEO_DECODER_DIRS[video_decoder]),
        audio_decoder=str(base / AUDIO_DIR),
        offload=offload,
        image_encoder=str(base / WAN_DIR) if image_encoder or (
            image_encoder is None and (base / vae).is_file()) else None,
        refiner=refiner,
        refiner_config=refiner_config,
        refiner_problem=refiner_problem,
    )


def _wan_file() -> str:
    return wan_vae.CHECKPOINT_FILE


def _component(name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with any failure re-raised as a one-line `ValueError` naming ``name``."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(" ".join(str(e).split())) from None
    except Exception as e:  # unreadable / corrupt files: OSError, SafetensorError, pickle, ...
        msg = " ".join(str(e).split())
        raise ValueError(f"{name}: cannot be read ({type(e).__name__}: {msg})") from None


def check_release(release: Release) -> Release:
    """Check every header of ``release`` against the configs, reading no weight: the text
    encoder (`check_text_encoder`; its width must be ``text_in_channels``), the chosen video
    decoder (`check_turbo_vae` / `check_wan_vae`; 48 latent channels =
    ``video_in_channels``), the image encoder's ``vae/`` when it is used, the audio decoder
    (`check_oobleck_decoder`; ``latent_dim`` = ``audio_in_channels``), after the transformer
    (`check_checkpoint`, first: a folder read with the wrong configuration is named by its
    tensors), then the refiner. Raises a one-line
    `ValueError` naming the file or tensor. A refiner that fails its checks does not fail
    the folder: the release is returned without it, the reason in ``refiner_problem``
    (only a run of the refiner stage is refused, with that reason)."""
    cfg, root = release.model_config, Path(release.root)
    _, report = _component(release.transformer, check_checkpoint, cfg, release.transformer)
    release = dataclasses.replace(release, expert_format=report.expert_format)
    width = _component(release.text_encoder, text_encoder.check_text_encoder, release.text_encoder)
    pairs = [(f"{TEXT_ENCODER_DIR}/config.json hidden_size", width, "text_in_channels",
              cfg.text_in_channels)]
    if release.video_decoder == "turbo":
        tcfg = _component(release.video_decoder_path, turbo_vae.check_turbo_vae,
                          release.video_decoder_path)
        pairs.append((f"{TURBO_DIR}/{turbo_vae.CONFIG_FILE} latent_channels",
                      tcfg.latent_channels, "video_in_channels", cfg.video_in_channels))
    else:
        _component(release.video_decoder_path, wan_vae.check_wan_vae, release.video_decoder_path)
        pairs.append((f"{WAN_DIR}/{wan_vae.CHECKPOINT_FILE} z_dim", video_latents.LATENT_CHANNELS,
                      "video_in_channels", cfg.video_in_channels))
    if release.image_encoder is not None and release.video_decoder != "wan2.2":
        _component(release.image_encoder, wan_vae.check_wan_vae, release.image_encoder)
    acfg = _component(release.audio_decoder, audio_vae.check_oobleck_decoder,
                      release.audio_decoder)
    pairs.append((f"{AUDIO_DIR}/{audio_vae.CONFIG_FILE} latent_dim", acfg.latent_dim,
                  "audio_in_channels", cfg.audio_in_channels))
    for what, value, field, want in pairs:
        if value != want:
            raise ValueError(f"release folder {str(root)!r}: {what}={value} does not match "
                             f"the transformer configuration {cfg.name!r}: {field}={want}")
    if release.refiner is not None:
        try:
            check_refiner(release)
        except ValueError as e:
            return dataclasses.replace(release, refiner=None, refiner_config=None,
                                       refiner_problem=str(e))
    return release


def check_refiner(release: Release) -> None:
    """The refiner's headers (`check_refiner_checkpoint`) and its widths against the
    preview's (the same latents and text features). One-line `ValueError`."""
    cfg, rcfg = release.model_config, release.refiner_config
    implied = ("" if os.path.lexists(Path(release.root) / REFINER_DIR / MODEL_CONFIG) else
               f" ({REFINER_DIR}/{MODEL_CONFIG} is absent: the {IMPLIED_REFINER_CONFIG} "
               "preset is assumed)")
    for field in ("video_in_channels", "text_in_channels"):
        if getattr(rcfg, field) != getattr(cfg, field):
            raise ValueError(f"release folder {release.root!r}: {REFINER_DIR}/ {field}="
                             f"{getattr(rcfg, field)}{implied} does not match {PREVIEW_DIR}/"
                             f"{MODEL_CONFIG} {field}={getattr(cfg, field)}")
    _component(release.refiner, check_refiner_checkpoint, rcfg, release.refiner)


# ---------------------------------------------------------------------- public schema
def public_config(cfg: Any) -> dict[str, Any]:
    """``cfg`` (a `Magi2Config`) as a ``config.json`` in the public MAGI-2 schema (the
    inverse of `Magi2Config.from_dict`'s public branch; the fixed fields at the released
    values)."""
    top = ("num_layers", "hidden_size", "head_dim", "num_query_groups", "intermediate_factor",
           "video_in_channels", "audio_in_channels", "text_in_channels", "params_dtype")
    return {
        **{k: getattr(cfg, k) for k in top},
        "multimodal_layers": list(cfg.multimodal_layers),
        "attention_gating": True,
        "attention_sink_tokens": 1,
        "attention_softcap": -1.0,
        "mhc": {"alpha_init": 0.01, "enabled": True, "num_streams": cfg.mhc_streams,
                "sinkhorn_epsilon": cfg.mhc_eps, "sinkhorn_iterations": cfg.mhc_sinkhorn_iters},
        "moe": {
            "num_heads": cfg.moe_num_heads, "num_experts": cfg.moe_num_experts,
            "top_k": cfg.moe_top_k, "expert_intermediate_size": cfg.moe_expert_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "modality_shared_expert_intermediate_size":
                cfg.modality_shared_expert_intermediate_size,
            "routing_scale": cfg.moe_route_scale, "layers": list(cfg.moe_layer_ids),
            "normalize_routing_weights": True, "score_function": "sigmoid",
        },
    }


# ---------------------------------------------------------------------- the tiny folder
#: seeds and sizes of the embedded tiny release (part of its cache name)
TINY_SPEC: dict[str, Any] = {
    "format": 1,
    "transformer": {"preset": "tiny", "seed": 0, "max_shard_bytes": 16 << 20},
    "text_encoder": {"seed": 1001, "hidden_size": 64, "layers": 5},
    "turbo_vae": {"seed": 1002, "widths": [8, 16, 24, 32]},
    "vae": {"seed": 1004, "base_dim": 6, "decoder_base_dim": 8},
    "audio": {"seed": 1003, "channels": 8},
    "refiner": {"preset": "tiny-refiner", "seed": 1005},
}
TRANSFORMER_INDEX = f"model{INDEX_SUFFIX}"


def tiny_release_name() -> str:
    """``tiny-release-<hash>``: the hash covers `TINY_SPEC`, the tiny transformer config and
    tensor spec, and the versions of the libraries whose initialisers draw the weights."""


    rcfg = get_refiner_config(TINY_SPEC["refiner"]["preset"])
    rspec = {k: [list(s), str(d)] for k, (s, d) in refiner_spec(rcfg).items()}
    versions = [torch.__version__, *(version(n) for n in ("transformers", "tokenizers",
                                                          "diffusers"))]
    digest = spec_digest(get_config("tiny"), TINY_SPEC, rcfg.to_dict(), rspec, versions)
    return f"tiny-release-{digest}"


def write_tiny_release(folder: str | os.PathLike) -> None:
    """Write the tiny release layout into ``folder`` (created; deterministic)."""
    base, spec = Path(folder), TINY_SPEC
    cfg = get_config(spec["transformer"]["preset"])
    text = spec["text_encoder"]
    if cfg.text_in_channels != text["hidden_size"]:
        raise ValueError(f"tiny preset text_in_channels={cfg.text_in_channels} must equal the "
                         f"tiny text encoder's hidden_size={text['hidden_size']}")
    (base / PREVIEW_DIR).mkdir(parents=True, exist_ok=True)
    with open(base / PREVIEW_DIR / MODEL_CONFIG, "w") as f:
        json.dump(public_config(cfg), f, indent=1)
    write_random_checkpoint(cfg, base / PREVIEW_DIR / TRANSFORMER_INDEX,
                            seed=spec["transformer"]["seed"],
                            max_shard_bytes=spec["transformer"]["max_shard_bytes"])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar
    tiny_text_encoder.build_tiny_text_encoder(base / TEXT_ENCODER_DIR, seed=text["seed"],
                                              hidden_size=text["hidden_size"],
                                              layers=text["layers"])
    t = spec["turbo_vae"]
    turbo_vae.build_tiny_turbo_vae(base / TURBO_DIR, seed=t["seed"], widths=tuple(t["widths"]))
    w = spec["vae"]
    wan_vae.build_tiny_wan_vae(base / WAN_DIR, seed=w["seed"], base_dim=w["base_dim"],
                               decoder_base_dim=w["decoder_base_dim"])
    a = spec["audio"]
    audio_vae.build_tiny_audio_vae(base / AUDIO_DIR, seed=a["seed"], channels=a["channels"])
    _write_tiny_refiner(base / REFINER_DIR, spec["refiner"])


def _write_tiny_refiner(folder: Path, spec: dict[str, Any]) -> None:
    """refiner/config.json (our schema) and refiner/model.safetensors (random weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = get_refiner_config(spec["preset"])
    with open(folder / MODEL_CONFIG, "w") as f:
        json.dump({k: v for k, v in cfg.to_dict().items() if k != "name"}, f, indent=1)
    write_random_refiner(cfg, folder / "model.safetensors", seed=spec["seed"])


def tiny_release(cache_dir: str | os.PathLike, *, write: bool = True) -> Path:
    """The embedded default's folder ``<cache_dir>/<tiny_release_name()>``, written once
    (`headmoe.files.atomic_folder`: a concurrent writer that wins the rename is kept).
    ``write=False`` only names it."""
    path = Path(cache_dir).expanduser() / tiny_release_name()
    if not write or path.is_dir():
        return path
    return atomic_folder(path, write_tiny_release)
