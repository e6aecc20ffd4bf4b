"""The MAGI-2 glue of the pipeline: the transformer behind the `Denoiser` protocol, the
components of a job, and `resolve_model` (the embedded tiny checkpoint or a checkpoint path
with its model config)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from headmoe.distributed.context import ParallelContext
from headmoe.files import atomic_write
from headmoe.models.magi2 import (
    PRESETS,
    BranchInput,
    Magi2Config,
    Magi2Transformer,
    config_from_arg,
    get_config,
    load_checkpoint,
    spec_digest,
    write_random_checkpoint,
)
from headmoe.models.magi2.loading import stream_layers
from headmoe.models.refiner import Magi2Refiner, load_refiner
from headmoe.models.refiner.loading import stream_refiner
from headmoe.moe.formats import expert_format
from headmoe.pipeline.health import watch_layers
from headmoe.pipeline.interfaces import Components, Refiner
from headmoe.pipeline.job import GenerateJob
from headmoe.release import placement
from headmoe.release.folder import Release
from headmoe.release.standins import ByteTextEncoder, TinyAudioDecoder, TinyVideoDecoder

#: the seed of the embedded tiny model's random checkpoint
TINY_CHECKPOINT_SEED = 0


class Magi2Denoiser:
    """`Denoiser` over a `headmoe.models.magi2.Magi2Transformer`."""

    def __init__(self, model: Magi2Transformer):
        self.model = model

    @torch.no_grad()
    def __call__(
        self, branches: Sequence[BranchInput]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(o.video, o.audio) for o in self.model(list(branches))]


def _progress(ctx: ParallelContext, job: GenerateJob):
    """A function printing one ``headmoe: ...`` start-up line on stderr, on rank 0 of a job
    with a progress bar only (so that the seconds before the bar are not silent)."""
    def say(text: str) -> None:
        if job.progress and ctx.rank == 0:
            print(f"headmoe: {text}", file=sys.stderr, flush=True)
    return say


def job_release(job: GenerateJob) -> Release | None:
    """``job.release``, the `Release` folder this factory builds the components of (None:
    the stand-ins); a `TypeError` for another `headmoe.pipeline.interfaces.ReleaseFolder`."""
    if job.release is None or isinstance(job.release, Release):
        return job.release
    raise TypeError(f"job.release must be a headmoe.release.folder.Release, got "
                    f"{type(job.release).__name__}")


def magi2_components(ctx: ParallelContext, job: GenerateJob) -> Components:
    """The MAGI-2 transformer sharded by ``ctx`` with ``job.checkpoint`` loaded (or, with
    ``job.offload_layers``, its layers streamed from it: `stream_layers`), and either
    the release's components (``job.release``: `headmoe.release.placement`, text encoder on
    each node's first rank, decoders on the output rank, image encoder on rank 0) or the
    stand-in text encoder and decoders sized to the model's channels."""
    cfg = job.model_config
    say = _progress(ctx, job)
    say(f"building the transformer ({cfg.num_layers} layers) and loading its weights on "
        f"{ctx.world_size} rank(s)")
    experts = expert_format(job.expert_format)  # the routed experts' format (docs/fp8.md)
    if job.offload_layers:  # the layers' weights stream from the checkpoint's files
        model, streamer = stream_layers(
            cfg, ctx, job.request.torch_dtype, job.checkpoint,
            resident_layers=job.resident_layers, timeout_s=job.timeout_s, experts=experts,
            attention=job.deployment.attention)
        model.streamer = streamer  # lives (and streams) as long as the model
    else:
        with torch.device(ctx.device):  # allocate the weights where they run, not on the host
            model = Magi2Transformer(cfg, ctx, dtype=job.request.torch_dtype, experts=experts,
                                     attention=job.deployment.attention)
        load_checkpoint(model, job.checkpoint)
    model.eval()
    if job.check_layers:
        watch_layers(model)
    release = job_release(job)
    if release is not None:
        timeout = timedelta(seconds=job.timeout_s)
        say("loading the text encoder and the video and audio decoders")
        return Components(
            Magi2Denoiser(model),
            placement.node_text_encoder(ctx, release, timeout),
            placement.output_video_decoder(ctx, release),
            placement.output_audio_decoder(ctx, release),
            image_encoder=placement.world_image_encoder(ctx, release),
            refiner=refiner_component(ctx, job, None if job.offload_layers else model)
            if job.refiner is not None else None,
        )
    return Components(
        Magi2Denoiser(model),
        ByteTextEncoder(cfg.text_in_channels),
        TinyVideoDecoder(cfg.video_in_channels),
        TinyAudioDecoder(cfg.audio_in_channels),
    )


def refiner_component(ctx: ParallelContext, job: GenerateJob,
                      preview: Magi2Transformer | None) -> Refiner:
    """The release's refiner (``refiner/``) on ``ctx``'s SP groups, in the request's dtype,
    loaded on the device, or on the host with ``--offload`` (`Refiner` moves it to the
    device for the stage and ``preview``, the resident preview transformer or None when its
    layers stream, to the host meanwhile); with ``job.offload_layers`` its layers stream
    (`stream_refiner`) and nothing moves."""
    release = job_release(job)
    if release is None or release.refiner is None:
        has = "the job has no release folder" if release is None else \
            f"{release.root!r} has none"
        raise ValueError(f"refiner_height / refiner_width need a release folder with "
                         f"refiner/, and {has}")
    if job.offload_layers:  # its layers stream too (all 30: --resident-layers is the preview's)
        model, streamer = stream_refiner(release.refiner_config, ctx, job.request.torch_dtype,
                                         release.refiner, timeout_s=job.timeout_s)
        model.streamer = streamer
        return Refiner(model.eval(), preview, ctx.device, False)
    device = placement.load_device(ctx.device, release.offload)
    with torch.device(device):
        model = Magi2Refiner(release.refiner_config, ctx, dtype=job.request.torch_dtype)
    load_refiner(model, release.refiner)
    model.eval()
    return Refiner(model, preview, ctx.device, release.offload)


def resolve_model(
    model: str,
    cache_dir: str | os.PathLike,
    model_config: str | None = None,
    *,
    write: bool = True,
) -> tuple[Magi2Config, str]:
    """``(Magi2Config, checkpoint path)`` for ``model``: the preset "tiny" (deterministic
    random weights, seed `TINY_CHECKPOINT_SEED`, written once to ``cache_dir`` under a name
    that hashes the tensor spec, atomically; ``write=False`` only names the file) or a
    checkpoint path (``.safetensors`` or ``.safetensors.index.json``) whose config is the
    preset ``model_config`` or a ``config.json`` (a `Magi2Config.to_dict()`) in the
    checkpoint's folder.

    Raises `ValueError` naming ``model`` / ``model_config`` for anything else."""

    if model == "tiny":
        cfg = get_config("tiny")
        name = f"tiny-seed{TINY_CHECKPOINT_SEED}-{spec_digest(cfg, TINY_CHECKPOINT_SEED)}"
        path = Path(cache_dir).expanduser() / f"{name}.safetensors"
        if write and not path.exists():
            atomic_write(path, lambda tmp: write_random_checkpoint(cfg, tmp,
                                                                   seed=TINY_CHECKPOINT_SEED))
        return cfg, str(path)
    if model in PRESETS:
        raise ValueError(
            f"model={model!r}: only the 'tiny' preset has embedded random weights; pass a "
            f"checkpoint path and model_config={model!r}"
        )
    path = Path(model).expanduser()
    if not path.is_file() or not path.name.endswith((".safetensors", ".safetensors.index.json")):
        raise ValueError(
            f"model must be 'tiny', a release folder or an existing .safetensors / "
            f".safetensors.index.json file, got {model!r}"
        )
    if model_config is not None:
        return config_from_arg(model_config), str(path)
    cfg_file = path.parent / "config.json"
    if not cfg_file.is_file():
        raise ValueError(
            f"model={model!r} has no config.json next to it; set model_config to a preset "
            f"({', '.join(sorted(PRESETS))}) or a model config JSON file"
        )
    return Magi2Config.from_json(cfg_file), str(path)


