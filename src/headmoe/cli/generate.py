"""`headmoe generate`: a prompt in, an mp4 (H.264 + AAC) and a JSON sidecar out.

Every flag is checked in the launching process before any rank starts (request fields, the
parallel layout against the world size via `plan_topology`, the model config against the
layout); errors name the flags. Then:

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) this process is one rank of that world;
- with ``--nproc 1`` the job runs in this process;
- with ``--nproc N`` N local ranks start through `headmoe.distributed.launch` (spawn, its
  store, Gloo on CPU / NCCL on GPU). If any rank fails, the others are stopped after the
  launcher's grace, the failing rank's message is printed and the exit code is 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, cast

from headmoe.admission import GIVEN_BY_FLAG, Admitted, admit, check_given
from headmoe.cli import checks, flags, samples
from headmoe.deployment import build_deployment
from headmoe.distributed.context import set_rank_threads
from headmoe.distributed.launch import launch_local, torchrun_env
from headmoe.errors import Refusal, UserError
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.image import ImageError, ReferenceImage
from headmoe.pipeline.image_worker import read_image
from headmoe.pipeline.interfaces import ReleaseFolder
from headmoe.pipeline.job import GenerateJob
from headmoe.pipeline.request import GenerateRequest
from headmoe.planner.time import record_steps
from headmoe.release.components import magi2_components
from headmoe.release.folder import RANDOM_WEIGHTS_NOTE

#: generate's flags (`headmoe.cli.flags`), in the order ``--help`` lists them
MODEL_FLAGS = ("model", "model_config", "video_decoder", "offload", "offload_layers",
               "resident_layers", "expert_format", "attention", "cuda_graphs", "cache_dir")
REQUEST_FLAGS = ("image", "negative_prompt", "resolution", "size", "height", "width",
                 "num_frames", "fps", "num_inference_steps", "seed", "guidance_scale",
                 "audio_guidance_scale", "shift", "seconds", "sampler", "dtype",
                 "noise_device", "refiner_height", "refiner_width", "refiner_steps")
RUN_FLAGS = ("output", "nproc", "timeout", "no_progress", "overwrite", "max_memory_gib",
             "max_time", "check_weights")


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
    add_flags(p)
    p.set_defaults(run=run)


def add_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``generate`` (`headmoe.cli.flags`; compare forwards them)."""
    flags.add(p, *MODEL_FLAGS)
    flags.add(p.add_mutually_exclusive_group(required=True), "prompt", "prompt_file",
              "samples")
    flags.add(p, *REQUEST_FLAGS, *flags.LAYOUT_FIELDS, *RUN_FLAGS,
              max_time={"help": flags.time_help(None)})


def build_job(args: argparse.Namespace) -> tuple[GenerateJob, int]:
    """Validate every flag and build the `GenerateJob` and the world size (pure checks plus
    writing the tiny release once): the request's fields, the output, the `Deployment`
    (`build_deployment`), then the one `admit`. Raises `Refusal` for a refused request
    field (reported with the fields as flags), `ValueError` with flag names for the rest."""
    checks.check_args(args)  # the prompt (--prompt-file read, capped)
    image = getattr(args, "image", None) is not None
    try:
        given = flags.given_request(args)
        check_given(given)  # every request field, before anything is written
        parallel = flags.parallel_of(args)
        output = Path(args.output)
        if output.suffix.lower() != ".mp4":
            raise ValueError(f"output must end in .mp4, got {args.output!r}")
        checks.check_output(output, args.overwrite, parallel.data_parallel_size)
        dep = build_deployment(flags.options_of(args, parallel=parallel, image_encoder=image))
        admitted = admit(given, dep, image=image)
        checks.check_weights(dep, args.check_weights)
    except Refusal:
        raise
    except ValueError as exc:
        kind = UserError if isinstance(exc, UserError) else ValueError
        raise kind(flags.as_flags(str(exc))) from None
    checks.print_admitted(admitted.notes, dep)
    image_path = getattr(args, "image", None)
    return _job(args, dep, admitted, output, image_path), dep.parallel.world_size


def _job(args: argparse.Namespace, dep: Deployment, admitted: Admitted, output: Path,
         image_path: str | None) -> GenerateJob:
    """The `GenerateJob` of one admitted request (its image read from ``image_path``)."""
    return GenerateJob(
        deployment=dep, request=admitted.request, refiner=admitted.refiner,
        output=str(output), image=_image(image_path, args.model, admitted.request, dep.release),
        progress=not args.no_progress, check_layers=getattr(args, "debug", False),
        overwrite=args.overwrite, components=magi2_components,
        extra={"command": ["headmoe", *sys.argv[1:]] if sys.argv else [],
               "admission": admitted.describe()})


def build_sample_jobs(args: argparse.Namespace) -> tuple[list[GenerateJob], int]:
    """``--samples``: every line read and admitted (`headmoe.cli.samples`) on one
    `Deployment` before any rank starts, the command's request flags each line's
    defaults; the jobs in line order and the world size. `UserError` naming the line."""
    try:
        defaults = flags.given_request(args)
        check_given(defaults)
        parallel = flags.parallel_of(args)
    except Refusal:
        raise
    except ValueError as exc:
        raise ValueError(flags.as_flags(str(exc))) from None
    lines = samples.read_samples(args, defaults)
    try:
        dep = build_deployment(flags.options_of(
            args, parallel=parallel, image_encoder=any(s.image for s in lines)))
        checks.check_weights(dep, args.check_weights)
    except ValueError as exc:
        kind = UserError if isinstance(exc, UserError) else ValueError
        raise kind(flags.as_flags(str(exc))) from None
    jobs = []
    for line, admitted in zip(lines, samples.admit_samples(lines, dep, GIVEN_BY_FLAG),
                              strict=True):
        checks.print_admitted(admitted.notes, dep)
        try:
            jobs.append(_job(args, dep, admitted, line.output, line.image))
        except UserError as exc:
            raise UserError(f"--samples line {line.line}: {exc}") from None
    return jobs, dep.parallel.world_size


def _image(path: str | None, model: str, request: GenerateRequest,
           release: ReleaseFolder | None) -> ReferenceImage | None:
    """The checked, preprocessed image at ``path`` (``--image``;
    `headmoe.pipeline.image_worker.read_image`), or None; refused with a model that has no
    image encoder."""
    if path is None:
        return None
    if release is None or release.image_encoder is None:
        raise UserError(f"--image needs a release folder with vae/ (the Wan2.2 encoder), not "
                        f"--model {model!r}")
    try:
        image = read_image(path, request.height, request.width)
    except ImageError as exc:
        raise UserError(str(exc)) from None
    if image.frames > 1:
        print(f"headmoe: note: --image {path!r} is animated ({image.frames} frames); "
              "its first frame is used", file=sys.stderr)
    return image


def startup_line(job: GenerateJob, world: int) -> str:
    """The line printed before the ranks start: the ranks and their CPU threads, and what
    the request makes (size, frames, fps and seconds as rounded, steps)."""
    from headmoe.distributed.context import rank_threads
    from headmoe.planner.time import MEASURED, format_seconds

    env = torchrun_env()
    threads = rank_threads(env.local_world_size if env is not None else world)
    req = job.request
    per = f", {threads} CPU thread(s) each" if threads else " (CUDA)"
    made = (f"{req.width}x{req.height}, {req.num_frames} frames at {req.fps:g} fps = "
            f"{req.num_frames / req.fps:.3g} s, {req.num_inference_steps} steps")
    if job.refiner is not None:
        made += f", then the refiner at {job.refiner.width}x{job.refiner.height}"
    admission = job.extra.get("admission", {})
    estimate = admission.get("time_estimate_s")
    how = ("measured steps" if admission.get("time_estimate_source") == MEASURED
           else "FLOP-rate estimate")
    took = ("" if estimate is None
            else f"; estimated ~{format_seconds(estimate)} of steps ({how})")
    return (f"headmoe: checked the request and the model; starting {world} rank(s){per}; "
            f"making {made}{took}")


def run(args: argparse.Namespace) -> int:
    """Run ``headmoe generate``; returns the exit code."""
    t0 = time.perf_counter()
    # ValueError: bad input, reported by headmoe.cli.errors
    if args.samples is not None:
        jobs, world = build_sample_jobs(args)
    else:
        job, world = build_job(args)
        jobs = [job]
    env = torchrun_env()
    if env is None or env.rank == 0:
        if args.model == "tiny":
            print(f"headmoe: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
        if not args.no_progress:
            line = startup_line(jobs[0], world)
            if args.samples is not None:
                line = (f"headmoe: checked the {len(jobs)} requests of --samples {args.samples!r}"
                        f" and the model; starting {world} rank(s) for all of them")
            print(line, file=sys.stderr, flush=True)
    results = _run_jobs(jobs, world, env is not None, args.samples is not None)
    if results and (env is None or env.rank == 0):  # the next estimate of this cost
        for job, res in zip(jobs, results, strict=False):  # rank 0's results come first
            record_steps(job.deployment.step_cache,
                         job.extra["admission"].get("step_key") or "",
                         res.get("step_times_s") or [])
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


def _run_jobs(jobs: list[GenerateJob], world: int, torchrun: bool,
              loaded: bool) -> list[Any]:
    """Every rank's results of ``jobs`` (one: `run_job`; ``loaded``, the samples: all on
    one model load, `run_loaded`), under torchrun, in this process or on local ranks."""
    from headmoe.distributed.context import ParallelContext, rank_device
    from headmoe.pipeline.job import launched_rank, launched_samples, run_job, run_loaded

    entry: Any = launched_samples if loaded else launched_rank
    arg: Any = jobs if loaded else jobs[0]
    if torchrun:
        from torch.distributed.elastic.multiprocessing.errors import record

        results = [record(entry)(arg)]
    elif world == 1:
        set_rank_threads(1)  # the cores this process may use, not the machine's
        ctx = ParallelContext.single(jobs[0].parallel, device=rank_device())
        results = [run_loaded(ctx, jobs) if loaded else run_job(ctx, jobs[0])]
    else:
        results = cast(list[Any], launch_local(entry, world, (arg,)))
    # the samples: each rank's list of results, one per job
    return [r for rank in results for r in rank] if loaded else results
