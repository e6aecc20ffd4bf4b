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
import dataclasses
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from headmoe.admission import (
    INPUT_FIELDS,
    Admitted,
    Deployment,
    admit,
    check_given,
    local_ranks,
    memory_budget,
)
from headmoe.cli import checks
from headmoe.cli.plan import add_stream_arguments
from headmoe.config import MOE_EXCHANGES, ParallelConfig
from headmoe.distributed.context import set_rank_threads
from headmoe.distributed.launch import launch_local, torchrun_env
from headmoe.distributed.topology import plan_topology
from headmoe.errors import Refusal, UserError
from headmoe.pipeline.job import check_timeout
from headmoe.pipeline.recipe import RELEASED, RESOLUTIONS, TINY
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import DTYPES, NOISE_DEVICES, GenerateRequest
from headmoe.pipeline.sampler import SAMPLERS
from headmoe.release.folder import RANDOM_WEIGHTS_NOTE, VIDEO_DECODERS

#: the layout flags are the fields of `ParallelConfig` (dest = field name)
LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ParallelConfig))

#: config / request field -> flag, for error messages
FLAGS: dict[str, str] = {
    **{name: "--" + name.replace("_", "-") for name in INPUT_FIELDS},
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            *LAYOUT_FIELDS,
            "model",
            "model_config",
            "output",
            "timeout",
            "max_time",
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


#: another library's error quoted in a message, "(RuntimeError: Storage size ...)": its words
#: are not our fields
_QUOTED_ERROR = re.compile(r"(\([A-Z]\w*(?:Error|Exception|Warning|Fault)\b[^)]*\))")


def flagify(message: str, assignments_only: bool = False) -> str:
    """Rewrite field names in a validation message as the flags that set them: every
    ``name=`` and (unless ``assignments_only``, as for admission's refusals, which always
    write ``name=value``) a leading or free-standing ``name ``; not inside another
    library's error quoted in parentheses (`_QUOTED_ERROR`)."""
    follow = "=" if assignments_only else "[= ]"
    parts = _QUOTED_ERROR.split(message)
    for i in range(0, len(parts), 2):  # odd parts: another library's error, kept as is
        for name, flag in FLAGS.items():
            parts[i] = re.sub(rf"(?:^|(?<=[\s(,'\"])){name}(?={follow})", flag, parts[i])
    return "".join(parts)


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="text -> video + audio mp4",
        description="Generate a video with sound from a prompt, on one or many ranks. "
        "Request flags left out take the model's recipe: the embedded tiny release's fast "
        "CPU defaults, or MAGI-2 Preview's released recipe (540p, 10 s, 100 steps, bf16 on a "
        "GPU, shift 7, guidance 5.0/7.0, the released negative prompt, seed 42); the sidecar "
        "records which fields came from a flag.",
    )
    _add_model_flags(p)
    _add_request_flags(p)
    _add_refiner_flags(p)
    add_layout_flags(p)
    _add_run_flags(p)
    checks.add_arguments(p)
    p.set_defaults(run=run)


def _add_refiner_flags(p: argparse.ArgumentParser) -> None:
    """--refiner-height, --refiner-width, --refiner-steps (the 1080p stage)."""
    stage = RefinerStage()
    p.add_argument("--refiner-height", type=int, default=None,
                   help="run the release's refiner (refiner/) after the preview, at this "
                   f"height in pixels (a multiple of 16; default {stage.height}, or the "
                   "--resolution preset's); the clip gets 2T-1 latent frames at twice the fps")
    p.add_argument("--refiner-width", type=int, default=None,
                   help=f"refiner width in pixels (a multiple of 16; default {stage.width})")
    p.add_argument("--refiner-steps", type=int, default=None,
                   help=f"refiner sampler steps (default {stage.steps})")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --model-config, --video-decoder, --offload, --offload-layers,
    --resident-layers, --cache-dir."""
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (embedded tiny release folder, random weights; the default), a MAGI-2 "
        "Preview release folder (preview/, text_encoder/, turbo_vae/, vae/, "
        "stable-audio-open-1.0/), or a transformer checkpoint (.safetensors / "
        ".safetensors.index.json; stand-in encoders)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="transformer configuration: a preset (tiny, magi2-preview) or a JSON file in the "
        "public MAGI-2 config schema (default: a checkpoint file's config.json next to it; a "
        "release folder's preview/config.json, or magi2-preview where it has none, as "
        "published)",
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
        help="where the tiny release folder is written once (default: ~/.cache/headmoe)",
    )


def _both(field: str, fmt: Callable[[Any], str] = str) -> str:
    """"(default: X for the tiny release, Y for MAGI-2 Preview)" of a request field."""
    tiny, rel = TINY.values[field], RELEASED.values[field]
    if fmt(tiny) == fmt(rel):
        return f"(default: {fmt(tiny)})"
    return f"(default: {fmt(tiny)} for the tiny release, {fmt(rel)} for MAGI-2 Preview)"


#: request flags that are a field, a type and a help line (default: the model's recipe)
_PLAIN_FIELDS: tuple[tuple[str, type, str], ...] = (
    ("height", int, "pixels, a multiple of 16"),
    ("width", int, "pixels, a multiple of 16"),
    ("num_frames", int, "output frames, of the form 4k+1"),
    ("fps", float, "frame rate"),
    ("num_inference_steps", int, "denoising steps"),
    ("seed", int, "noise seed; data-parallel group k uses seed + k"),
    ("guidance_scale", float, "video CFG scale"),
    ("audio_guidance_scale", float, "audio CFG scale"),
    ("shift", float, "flow-matching time shift"),
)


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """The request: prompts, size, steps, seed, guidance, sampler, dtype. Every default is
    None: admission fills what is not given from the model's recipe and records which
    fields came from a flag (`headmoe.admission`)."""
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
    p.add_argument("--negative-prompt", default=None,
                   help="text of the unconditional branch (default: headmoe's short list for "
                   "the tiny release, the released 1,721-character text for MAGI-2 Preview)")
    p.add_argument("--resolution", default=None, metavar="{" + ",".join(RESOLUTIONS) + "}",
                   help="size preset: " + ", ".join(f"{k} = {w}x{h}" for k, (h, w) in
                                                      RESOLUTIONS.items())
                   + " (1080p: the 896x512 preview, then the release's refiner/ at 1920x1088 "
                   "and twice the fps) (default: 540p for MAGI-2 Preview; the tiny release "
                   "uses --height/--width)")
    p.add_argument("--size", default=None, metavar="WxH",
                   help="width x height in pixels, e.g. 896x512 (the HTTP API's size field)")
    for field, kind, what in _PLAIN_FIELDS:
        p.add_argument("--" + field.replace("_", "-"), type=kind, default=None,
                       help=f"{what} {_both(field)}")
    p.add_argument("--seconds", type=float, default=None,
                   help="clip length; num_frames = the largest 4k+1 <= seconds x fps (the "
                   "release makes 10 s = 125 frames at 12.5 fps; other lengths are headmoe's "
                   "extension, noted in the sidecar) (default: 10 for MAGI-2 Preview; the "
                   "tiny release uses --num-frames)")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="unipc: the released scheduler (docs/pipeline.md section 3) "
                   f"{_both('sampler')}")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="transformer dtype (default: fp32 for the tiny release; MAGI-2 "
                   "Preview: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument(
        "--noise-device", choices=NOISE_DEVICES, default=None,
        help="generator of the initial noise: cpu gives the same bytes on every layout and "
        "machine; cuda draws on the GPU as the reference does (values depend on the GPU "
        f"model) {_both('noise_device')}",
    )


def given_request(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the flags give (those not None), ``prompt`` included when read."""
    return {k: getattr(args, k) for k in INPUT_FIELDS if getattr(args, k, None) is not None}


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    """SP, CFG, DP and head-EP degrees and the MoE exchange."""
    p.add_argument("--ulysses-degree", type=int, default=1,
                   help="SP: ranks that share one sequence (Ulysses) (default: 1)")
    p.add_argument("--cfg-parallel-size", type=int, default=1,
                   help="1: both CFG branches in one forward; 2: one branch per SP group "
                   "(default: 1)")
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="independent requests; group k writes <stem>.dp<k>.mp4 (default: 1)",
    )
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the MoE layers' heads over EP ranks of the SP group")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        help="EP degree (divides --ulysses-degree); default: the SP group",
    )
    p.add_argument("--moe-exchange", choices=MOE_EXCHANGES, default="auto",
                   help="where MoE tokens are exchanged: ep_group, sp_group or auto (the MoE "
                   "layer's rule, docs/parallelism.md) (default: auto)")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """--output, --nproc, --timeout, --no-progress."""
    p.add_argument("--output", default="output.mp4",
                   help="mp4 path; sidecar: .json next to it (default: output.mp4)")
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
        "stopped responding is named (default: 60)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parallel_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The layout the flags give (the flags are `ParallelConfig`'s fields)."""
    return ParallelConfig(**{name: getattr(args, name) for name in LAYOUT_FIELDS})


def world_from_args(args: argparse.Namespace, parallel: ParallelConfig) -> int:
    """The world size: torchrun's, else ``--nproc``, else the layout's; it must be the
    layout's (`plan_topology` checks the rest). Raises `ValueError` naming the flags."""
    env = torchrun_env()
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be a positive number of ranks, got {args.nproc}")
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
    return world


def build_job(args: argparse.Namespace) -> tuple[Any, int]:
    """Validate every flag and build the `GenerateJob` and the world size (pure checks plus
    writing the tiny release once). Raises `Refusal` for a refused request field (reported
    with the fields as flags), `ValueError` with flag names for the rest."""
    job, world, _ = build(args)
    return job, world


def build(args: argparse.Namespace) -> tuple[Any, int, Deployment]:
    """`build_job` plus the `Deployment` its request was admitted on (serve keeps it)."""
    from headmoe.pipeline.job import GenerateJob
    from headmoe.release.components import magi2_components

    checks.check_args(args)  # the prompt (--prompt-file read, capped) and --max-memory-gib
    try:
        given = given_request(args)
        check_given(given)  # every request field, before anything is written
        parallel = parallel_from_args(args)
        world = world_from_args(args, parallel)
        check_timeout(args.timeout)
        output = Path(args.output)
        if output.suffix.lower() != ".mp4":
            raise ValueError(f"output must end in .mp4, got {args.output!r}")
        checks.check_output(output, args.overwrite, parallel.data_parallel_size)
        admitted, dep, checkpoint, release = _checked_model(args, given, parallel, world)
    except Refusal:
        raise
    except ValueError as exc:
        kind = UserError if isinstance(exc, UserError) else ValueError
        raise kind(flagify(str(exc))) from None
    for note in admitted.notes:
        print(f"headmoe: note: {note}", file=sys.stderr)
    if release is not None and release.refiner_problem is not None:  # admitted: not used
        print(f"headmoe: warning: refiner/ is not used (a run of the refiner stage is "
              f"refused): {release.refiner_problem}", file=sys.stderr)
    image = _image(args, admitted.request, release)  # its messages name --image themselves
    job = GenerateJob(
        admitted.request,
        parallel,
        dep.model_config,
        checkpoint,
        str(output),
        timeout_s=args.timeout,
        progress=not args.no_progress,
        check_layers=getattr(args, "debug", False),
        overwrite=args.overwrite,
        offload_layers=getattr(args, "offload_layers", False),
        resident_layers=getattr(args, "resident_layers", 0),
        extra={"command": ["headmoe", *sys.argv[1:]] if sys.argv else [],
               "admission": admitted.describe()},
        release=release,
        image=image,
        refiner=admitted.refiner,
        components=magi2_components,
    )
    return job, world, dep


def deployment(args: argparse.Namespace, model_config: Any, parallel: ParallelConfig,
               world: int, release: Any) -> Deployment:
    """The `Deployment` a request of ``args`` runs on (generate's and serve's): the device
    ranks use, the memory budget (``--max-memory-gib`` or the detected limit), the text
    encoder's token count."""
    from headmoe.cli.plan import stream_settings
    from headmoe.distributed.context import rank_device, rank_threads
    from headmoe.release.text_encoder import TokenCounter

    device = rank_device().type
    budget = memory_budget(args.max_memory_gib, "--max-memory-gib", local_ranks(world), device)
    count = TokenCounter(release.text_encoder) if release is not None else None
    name = getattr(model_config, "name", "?")
    return Deployment(model_config, parallel, device, count, budget,
                      f"--model {args.model} (config {name})",
                      stream_settings(args, model_config.num_layers),
                      threads=rank_threads(local_ranks(world)),
                      max_time_s=checks.check_max_time(getattr(args, "max_time", None)))


def _image(args: argparse.Namespace, request: GenerateRequest, release: Any) -> Any:
    """The checked, preprocessed ``--image`` (`headmoe.pipeline.image.read_image`), or
    None; refused with a model that has no image encoder."""
    if getattr(args, "image", None) is None:
        return None
    if release is None or release.image_encoder is None:
        raise UserError(f"--image needs a release folder with vae/ (the Wan2.2 encoder), not "
                        f"--model {args.model!r}")
    from headmoe.pipeline.image import ImageError
    from headmoe.pipeline.image_worker import read_image

    try:
        image = read_image(args.image, request.height, request.width)
    except ImageError as exc:
        raise UserError(str(exc)) from None
    if image.frames > 1:
        print(f"headmoe: note: --image {args.image!r} is animated ({image.frames} frames); "
              "its first frame is used", file=sys.stderr)
    return image


def _checked_model(args: argparse.Namespace, given: dict[str, Any], parallel: ParallelConfig,
                   world: int) -> tuple[Admitted, Deployment, str, Any]:
    """(admitted request, deployment, transformer checkpoint, release or None) of
    ``--model``, with every header, the layout and the request (admission, memory estimate
    included) checked before any weight is built."""
    from headmoe.models.magi2 import check_checkpoint, validate_parallel
    from headmoe.release.components import resolve_model
    from headmoe.release.folder import is_release_folder

    if args.model == "tiny" or is_release_folder(args.model):
        release = _release(args, parallel)  # checks every header
        model_config, checkpoint = release.model_config, release.transformer
        dep = dataclasses.replace(deployment(args, model_config, parallel, world, release),
                                  refiner_config=release.refiner_config, offload=args.offload,
                                  refiner_problem=release.refiner_problem or "")
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
        dep = deployment(args, model_config, parallel, world, None)
        admit(given, dep)  # before the tiny checkpoint is written
        _, checkpoint = resolve_model(args.model, args.cache_dir, args.model_config)
    if release is None or args.check_weights:
        headers, report = check_checkpoint(model_config, checkpoint)  # headers only
        checks.report_conversions(report)
        if args.check_weights:
            checks.scan_weights(checkpoint, headers, report.prefix)
            if release is not None:
                checks.scan_components(release)
    return admit(given, dep, image=getattr(args, "image", None) is not None), dep, \
        checkpoint, release


def _release(args: argparse.Namespace, parallel: ParallelConfig):
    """The checked `Release` of ``--model`` ('tiny': the embedded folder, written once after
    the cheap checks pass; a folder without preview/config.json is read as MAGI-2 Preview,
    ``--model-config`` supplies or replaces its configuration). Raises `ValueError` naming
    the flag, file or tensor."""
    import dataclasses

    from headmoe.models.magi2 import get_config, validate_parallel
    from headmoe.release import folder as rel

    video = args.video_decoder or "turbo"
    # --image needs the encoder; a server (image_encoder None) loads it when vae/ has it
    image = getattr(args, "image", None) is not None or getattr(args, "image_encoder", False)
    if args.model == "tiny":
        if args.model_config is not None:
            raise ValueError("model_config applies to a release folder or a checkpoint file, "
                             "not to the embedded model='tiny'")
        validate_parallel(get_config("tiny"), parallel)
        found = rel.find_release(rel.tiny_release(args.cache_dir), video, args.offload, image)
        found = dataclasses.replace(
            found, model_config=dataclasses.replace(found.model_config, name="tiny")
        )
    else:
        found = rel.find_release(args.model, video, args.offload, image, args.model_config)
        validate_parallel(found.model_config, parallel)
    found = rel.check_release(found)  # headers only, before any rank starts
    unused = rel.unused_entries(found)
    if unused and args.model != "tiny":  # the embedded folder has the release's, by design
        print(f"headmoe: warning: {len(unused)} component entries headmoe does not use (nor "
              "does the reference), listed in the sidecar's release.unused_entries",
              file=sys.stderr)
    return dataclasses.replace(found, unused=tuple(unused))


def startup_line(job: Any, world: int) -> str:
    """The line printed before the ranks start: the ranks and their CPU threads, and what
    the request makes (size, frames, fps and seconds as rounded, steps)."""
    from headmoe.distributed.context import rank_threads
    from headmoe.planner.time import format_seconds

    env = torchrun_env()
    threads = rank_threads(env.local_world_size if env is not None else world)
    req = job.request
    per = f", {threads} CPU thread(s) each" if threads else " (CUDA)"
    made = (f"{req.width}x{req.height}, {req.num_frames} frames at {req.fps:g} fps = "
            f"{req.num_frames / req.fps:.3g} s, {req.num_inference_steps} steps")
    if job.refiner is not None:
        made += f", then the refiner at {job.refiner.width}x{job.refiner.height}"
    estimate = job.extra.get("admission", {}).get("time_estimate_s")
    took = "" if estimate is None else f"; estimated ~{format_seconds(estimate)} of steps"
    return (f"headmoe: checked the request and the model; starting {world} rank(s){per}; "
            f"making {made}{took}")


def run(args: argparse.Namespace) -> int:
    """Run ``headmoe generate``; returns the exit code."""
    from headmoe.distributed.context import ParallelContext, rank_device
    from headmoe.pipeline.job import launched_rank, run_job

    t0 = time.perf_counter()
    job, world = build_job(args)  # ValueError: bad input, reported by headmoe.cli.errors
    env = torchrun_env()
    if env is None or env.rank == 0:
        if args.model == "tiny":
            print(f"headmoe: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
        if not args.no_progress:
            print(startup_line(job, world), file=sys.stderr, flush=True)
    if env is not None:
        from torch.distributed.elastic.multiprocessing.errors import record

        results = [record(launched_rank)(job)]
    elif world == 1:
        set_rank_threads(1)  # the cores this process may use, not the machine's
        ctx = ParallelContext.single(job.parallel, device=rank_device())
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
