"""`headmoe generate`: a prompt in, an mp4 (H.264 + AAC) and a JSON sidecar out.

Every flag is checked in the launching process before any rank starts (request fields, the
parallel layout against the world size via `plan_topology`, the model config against the
layout); errors name the flags. Then:

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) this process is one rank of that world;
- with ``--nproc 1`` the job runs in this process;
- with ``--nproc N`` N local ranks start through torch's elastic launcher (spawn, no
  restarts, Gloo on CPU / NCCL on GPU). If any rank fails, the others are stopped, the
  failing rank's message is printed and the exit code is 1.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from headmoe.cli import checks
from headmoe.cli.plan import add_stream_arguments
from headmoe.config import MOE_EXCHANGES, ParallelConfig
from headmoe.distributed.launch import launch_local, set_rank_threads, torchrun_env
from headmoe.distributed.topology import plan_topology
from headmoe.errors import UserError
from headmoe.pipeline.encoders import TinyAudioDecoder, TinyVideoDecoder
from headmoe.pipeline.job import MIN_TIMEOUT_S
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.release import RANDOM_WEIGHTS_NOTE, VIDEO_DECODERS
from headmoe.pipeline.request import DTYPES, NOISE_DEVICES, GenerateRequest
from headmoe.pipeline.sampler import SAMPLERS

_REQ_DEFAULTS = {f.name: f.default for f in fields(GenerateRequest)}
#: the layout flags are the fields of `ParallelConfig` (dest = field name)
LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ParallelConfig))

#: config / request field -> flag, for error messages
FLAGS: dict[str, str] = {
    **{name: "--" + name.replace("_", "-") for name in _REQ_DEFAULTS},
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            *LAYOUT_FIELDS,
            "model",
            "model_config",
            "output",
            "timeout",
            "video_decoder",
            "offload",
            "refiner_height",
            "refiner_width",
            "refiner_steps",
            "offload_layers",
            "resident_layers",
        )
    },
    "world_size": "--nproc",
}


def flagify(message: str) -> str:
    """Rewrite field names in a validation message as the flags that set them: a leading
    ``name `` and every ``name=``."""
    for name, flag in FLAGS.items():
        message = re.sub(rf"(?:^|(?<=[\s(,'\"])){name}(?=[= ])", flag, message)
    return message


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="text -> video + audio mp4",
        description="Generate a video with sound from a prompt, on one or many ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_flags(p)
    _add_request_flags(p)
    _add_refiner_flags(p)
    _add_layout_flags(p)
    _add_run_flags(p)
    checks.add_arguments(p)
    p.set_defaults(run=run)


def _add_refiner_flags(p: argparse.ArgumentParser) -> None:
    """--refiner-height, --refiner-width, --refiner-steps (the 1080p stage)."""
    stage = RefinerStage()
    p.add_argument("--refiner-height", type=int, default=None,
                   help="run the release's refiner (refiner/) after the preview, at this "
                   f"height in pixels (a multiple of 16; with --refiner-width, default "
                   f"{stage.height}); the clip gets 2T-1 latent frames at twice the fps")
    p.add_argument("--refiner-width", type=int, default=None,
                   help=f"refiner width in pixels (a multiple of 16; default {stage.width})")
    p.add_argument("--refiner-steps", type=int, default=None,
                   help=f"refiner sampler steps (default {stage.steps})")


def refiner_stage(args: argparse.Namespace, release: Any, parallel: ParallelConfig) -> Any:
    """The `RefinerStage` the refiner flags ask for (None: no refiner), checked against the
    release's refiner/ and the layout. Raises `ValueError` naming the flag."""
    from headmoe.models.refiner import validate_parallel

    given = {k: getattr(args, k, None) for k in ("refiner_height", "refiner_width",
                                                 "refiner_steps")}
    if all(v is None for v in given.values()):
        return None
    if release is None or release.refiner is None:
        where = "the embedded tiny release" if release is None else repr(release.root)
        raise ValueError(f"refiner_height / refiner_width / refiner_steps need a release folder "
                         f"with refiner/; {where} has none")
    d = RefinerStage()
    stage = RefinerStage(given["refiner_height"] or d.height, given["refiner_width"] or d.width,
                         d.steps if given["refiner_steps"] is None else given["refiner_steps"])
    validate_parallel(release.refiner_config, parallel)
    return stage


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --model-config, --video-decoder, --offload, --offload-layers,
    --resident-layers, --cache-dir."""
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (embedded tiny release folder, random weights), a MAGI-2 Preview release "
        "folder (preview/, text_encoder/, turbo_vae/, vae/, stable-audio-open-1.0/), or a "
        "transformer checkpoint (.safetensors / .safetensors.index.json; stand-in encoders)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="model config of a checkpoint file: a preset (tiny, magi2-preview) or a JSON file "
        "in the public MAGI-2 config schema; default: the config.json next to the checkpoint",
    )
    p.add_argument(
        "--video-decoder",
        choices=VIDEO_DECODERS,
        default=None,
        help="release folders: the distilled TurboV3 decoder (turbo_vae/, default) or the full "
        "Wan2.2 VAE (vae/)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="release folders: keep the text encoder and decoders on the host between uses "
        "(moved to the device only while they run)",
    )
    add_stream_arguments(p)
    p.add_argument(
        "--cache-dir",
        default="~/.cache/headmoe",
        help="where the tiny release folder is written once",
    )


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """The request: prompts, size, steps, seed, guidance, sampler, dtype."""
    d = _REQ_DEFAULTS
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        default=None,
        help="UTF-8 text, raw (no template); the text encoder's token limit applies "
        "(truncation is warned about and recorded in the sidecar)",
    )
    p.add_argument(
        "--image",
        default=None,
        metavar="PATH",
        help="image-to-video: a PNG, JPEG or WebP file whose content becomes the first frame "
        "(release folders; the prompt gets the <Figure 1> marker)",
    )
    p.add_argument(
        "--negative-prompt",
        default=d["negative_prompt"],
        help="text of the unconditional branch (default: headmoe's own list of defects)",
    )
    p.add_argument("--height", type=int, default=d["height"])
    p.add_argument("--width", type=int, default=d["width"])
    p.add_argument("--num-frames", type=int, default=d["num_frames"])
    p.add_argument("--fps", type=float, default=d["fps"])
    p.add_argument("--num-inference-steps", type=int, default=d["num_inference_steps"])
    p.add_argument(
        "--seed",
        type=int,
        default=d["seed"],
        help="noise seed; data-parallel group k uses seed + k",
    )
    p.add_argument(
        "--guidance-scale", type=float, default=d["guidance_scale"], help="video CFG scale"
    )
    p.add_argument("--audio-guidance-scale", type=float, default=d["audio_guidance_scale"])
    p.add_argument("--shift", type=float, default=d["shift"], help="flow-matching time shift")
    p.add_argument("--sampler", choices=SAMPLERS, default=d["sampler"],
                   help="the released UniPC scheduler (docs/pipeline.md section 3)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d["dtype"])
    p.add_argument(
        "--noise-device", choices=NOISE_DEVICES, default=d["noise_device"],
        help="generator of the initial noise: cpu gives the same bytes on every layout and "
        "machine; cuda draws on the GPU as the reference does (values depend on the GPU model)",
    )


def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    """SP, CFG, DP and head-EP degrees and the MoE exchange."""
    p.add_argument("--ulysses-degree", type=int, default=1)
    p.add_argument("--cfg-parallel-size", type=int, default=1)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="independent requests; group k writes <stem>.dp<k>.mp4",
    )
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        help="EP degree (divides --ulysses-degree); default: the SP group",
    )
    p.add_argument("--moe-exchange", choices=MOE_EXCHANGES, default="auto")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """--output, --nproc, --timeout, --no-progress."""
    p.add_argument("--output", default="output.mp4", help="mp4 path; sidecar: .json next to it")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default: the layout's world size); not used under torchrun",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any collective may wait before the job fails and the rank that "
        "stopped responding is named",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_job(args: argparse.Namespace) -> tuple[Any, int]:
    """Validate every flag and build the `GenerateJob` and the world size (pure checks plus
    writing the tiny checkpoint once). Raises `ValueError` with flag names."""
    from headmoe.pipeline.job import GenerateJob

    checks.check_args(args)  # prompt, --num-frames, --seed: before anything else
    try:
        request = GenerateRequest(
            **{k: getattr(args, k) for k in _REQ_DEFAULTS if k != "prompt"}, prompt=args.prompt
        )
        parallel = ParallelConfig(
            ulysses_degree=args.ulysses_degree,
            cfg_parallel_size=args.cfg_parallel_size,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            expert_parallel_size=args.expert_parallel_size,
            moe_exchange=args.moe_exchange,
        )
        env = torchrun_env()
        if env is not None and args.nproc is not None and args.nproc != env.world_size:
            raise ValueError(
                f"--nproc {args.nproc} does not match the torchrun world of {env.world_size} "
                "ranks (leave --nproc out under torchrun)"
            )
        world = env.world_size if env is not None else (args.nproc or parallel.world_size)
        if world != parallel.world_size:
            raise ValueError(
                f"{'the torchrun world' if env else '--nproc'} has {world} ranks but the "
                f"layout needs --ulysses-degree {parallel.ulysses_degree} x --cfg-parallel-size "
                f"{parallel.cfg_parallel_size} x --data-parallel-size "
                f"{parallel.data_parallel_size} = {parallel.world_size}"
            )
        plan_topology(world, parallel)
        checks.check_noise_device(request.noise_device)
        if not args.timeout >= MIN_TIMEOUT_S:  # NaN too
            raise ValueError(f"timeout must be >= {MIN_TIMEOUT_S:g} seconds (it also bounds "
                             f"joining the ranks), got {args.timeout!r}")
        output = Path(args.output)
        if output.suffix.lower() != ".mp4":
            raise ValueError(f"output must end in .mp4, got {args.output!r}")
        checks.check_output(output, args.overwrite, parallel.data_parallel_size)
        model_config, checkpoint, release = _checked_model(args, request, parallel, world)
        refiner = refiner_stage(args, release, parallel)
    except ValueError as exc:
        kind = UserError if isinstance(exc, UserError) else ValueError
        raise kind(flagify(str(exc))) from None
    image = _image(args, request, release)  # its messages name --image themselves
    job = GenerateJob(
        request,
        parallel,
        model_config,
        checkpoint,
        str(output),
        timeout_s=args.timeout,
        progress=not args.no_progress,
        check_layers=getattr(args, "debug", False),
        overwrite=args.overwrite,
        offload_layers=getattr(args, "offload_layers", False),
        resident_layers=getattr(args, "resident_layers", 0),
        extra={"command": ["headmoe", *sys.argv[1:]] if sys.argv else []},
        release=release,
        image=image,
        refiner=refiner,
    )
    return job, world


def _image(args: argparse.Namespace, request: GenerateRequest, release: Any) -> Any:
    """The checked, preprocessed ``--image`` (`headmoe.pipeline.image.read_image`), or
    None; refused with a model that has no image encoder."""
    if getattr(args, "image", None) is None:
        return None
    if release is None or release.image_encoder is None:
        raise UserError(f"--image needs a release folder with vae/ (the Wan2.2 encoder), not "
                        f"--model {args.model!r}")
    from headmoe.pipeline.image import ImageError, read_image

    try:
        return read_image(args.image, request.height, request.width)
    except ImageError as exc:
        raise UserError(str(exc)) from None


def _checked_model(args: argparse.Namespace, request: GenerateRequest,
                   parallel: ParallelConfig, world: int) -> tuple[Any, str, Any]:
    """(model config, transformer checkpoint, release or None) of ``--model``, with every
    header, the layout and the memory estimate checked before any weight is built."""
    from headmoe.models.magi2 import check_checkpoint, validate_parallel
    from headmoe.pipeline.magi2 import resolve_model
    from headmoe.pipeline.release import is_release_folder

    if args.model == "tiny" or is_release_folder(args.model):
        release = _release(args, request, parallel)  # checks every header
        model_config, checkpoint = release.model_config, release.transformer
        checks.check_memory(args, model_config, request, parallel, world)
    else:
        release = None
        for name in ("video_decoder", "offload"):
            if getattr(args, name):
                raise ValueError(f"{name} applies to a release folder, not to "
                                 f"model={args.model!r}")
        model_config, _ = resolve_model(
            args.model, args.cache_dir, args.model_config, write=False
        )
        validate_parallel(model_config, parallel)
        TinyVideoDecoder(1).latent_shape(request.num_frames, request.height, request.width)
        request.audio_samples(TinyAudioDecoder.sample_rate)
        checks.check_memory(args, model_config, request, parallel, world)  # before any weight
        _, checkpoint = resolve_model(args.model, args.cache_dir, args.model_config)
    if release is None or args.check_weights:
        headers, report = check_checkpoint(model_config, checkpoint)  # headers only
        checks.report_conversions(report)
        if args.check_weights:
            checks.scan_weights(checkpoint, headers, report.prefix)
            if release is not None:
                checks.scan_components(release)
    return model_config, checkpoint, release


def _release(args: argparse.Namespace, request: GenerateRequest, parallel: ParallelConfig):
    """The checked `Release` of ``--model`` ('tiny': the embedded folder, written once after
    the cheap checks pass). Raises `ValueError` naming the flag, file or tensor."""
    import dataclasses

    from headmoe.models.magi2 import get_config, validate_parallel
    from headmoe.pipeline import release as rel
    from headmoe.pipeline import video_latents

    if args.model_config is not None:
        raise ValueError(f"model_config applies to a checkpoint file; the release folder "
                         f"model={args.model!r} carries preview/{rel.MODEL_CONFIG}")
    video = args.video_decoder or "turbo"
    video_latents.latent_shape(request.num_frames, request.height, request.width)
    request.audio_samples(44100)
    image = getattr(args, "image", None) is not None
    if args.model == "tiny":
        validate_parallel(get_config("tiny"), parallel)
        found = rel.find_release(rel.tiny_release(args.cache_dir), video, args.offload, image)
        found = dataclasses.replace(
            found, model_config=dataclasses.replace(found.model_config, name="tiny")
        )
    else:
        found = rel.find_release(args.model, video, args.offload, image)
        validate_parallel(found.model_config, parallel)
    rel.check_release(found)  # headers only, before any rank starts
    return found


def run(args: argparse.Namespace) -> int:
    """Run ``headmoe generate``; returns the exit code."""
    import torch

    from headmoe.distributed.context import ParallelContext
    from headmoe.pipeline.job import launched_rank, run_job

    t0 = time.perf_counter()
    job, world = build_job(args)  # ValueError: bad input, reported by headmoe.cli.errors
    env = torchrun_env()
    if env is None or env.rank == 0:
        if args.model == "tiny":
            print(f"headmoe: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
        if not args.no_progress:
            print(f"headmoe: checked the request and the model; starting {world} rank(s)",
                  file=sys.stderr, flush=True)
    if env is not None:
        from torch.distributed.elastic.multiprocessing.errors import record

        results = [record(launched_rank)(job)]
    elif world == 1:
        set_rank_threads(1)  # the cores this process may use, not the machine's
        ctx = ParallelContext.single(job.parallel)
        if torch.cuda.is_available():  # where launched ranks run too (NCCL, cuda)
            ctx.device = torch.device("cuda", torch.cuda.current_device())
        results = [run_job(ctx, job)]
    else:
        for name in ("torch.distributed.elastic", "torch.multiprocessing"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        results = launch_local(launched_rank, world, (job,))
    for res in results:
        if res["output"]:
            print(
                f"wrote {res['output']} and {res['sidecar']} (seed {res['seed']}, "
                f"video_sha256 {res['video_sha256'][:16]}, audio_sha256 "
                f"{res['audio_sha256'][:16]})"
            )
    if env is None:
        print(f"done in {time.perf_counter() - t0:.1f} s on {world} rank(s)")
    return 0
