"""The per-rank text-to-video+audio job: noise, CFG branches, sampler loop, decode, output.

Every rank of a request runs `run_job` with the same `GenerateJob`:

1. Noise, drawn as the release draws it: one generator seeded with ``seed + dp_index`` (DP
   group k runs the request with seed ``seed + k``), then video ``randn(1, C_video, T_lat,
   H_lat, W_lat)`` first and audio ``randn(1, T_audio, C_audio)`` second, kept as
   ``[T_lat, H_lat, W_lat, C_video]`` and ``[T_audio, C_audio]``. On the CPU generator
   (default) every rank of a DP group holds the same noise whatever the layout or device;
   ``noise_device="cuda"`` draws on the rank's CUDA generator as the reference does.
2. Each step ``i`` (the released schedule, `headmoe.pipeline.sampler`) the rank's SP group
   runs the transformer at the integer timestep ``t_i`` (model time ``float32(t_i)/1000``)
   on its branches: with
   ``cfg_parallel_size=1`` both ``[cond, uncond]`` packed in one forward; with 2 only the
   branch of its CFG rank (0 = cond, 1 = uncond), and the predictions are all-gathered over
   the CFG group (one collective). Every rank then combines them,
   ``v = v_u + s (v_c - v_u)`` (``s`` = `guidance_scale` for video, `audio_guidance_scale`
   for audio), and steps its own video and audio samplers: identical inputs, identical
   elementwise arithmetic, so every rank holds the same latents.
3. The writer of each DP group (its rank with SP and CFG coordinates 0) decodes, hashes
   and writes ``<output>`` (DP 1) or ``<stem>.dp<k><suffix>`` plus the JSON sidecar, after
   gathering every rank's step times and counters. Nothing is written if any step fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TypedDict, TypeVar, cast

import torch
import torch.distributed as dist
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no types (types-tqdm)

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext, set_rank_threads
from headmoe.distributed.launch import torchrun_env
from headmoe.distributed.topology import is_output_coords
from headmoe.distributed.watchdog import Heartbeat, interrupt_once, note_step
from headmoe.models.magi2 import BranchInput, Magi2Config
from headmoe.numerics import numerics_record, reproducible_blas, require_reproducible_blas
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.health import (
    DECODER_HINT,
    TextTokens,
    check_media,
    check_step,
    text_report,
    warn_truncated,
)
from headmoe.pipeline.i2v import ImageCondition, ensure_figure_token, image_condition
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.interfaces import Components, Refiner, ReleaseFolder, TextEncoder
from headmoe.pipeline.latents import frame_count
from headmoe.pipeline.media import (
    quantize_audio,
    sidecar_path,
    tensor_sha256,
    write_mp4,
    write_sidecar,
)
from headmoe.pipeline.refine import REFINER_FPS_FACTOR, RefinerStage, refine_stage
from headmoe.pipeline.request import GenerateRequest
from headmoe.pipeline.sampler import cfg_combine, make_sampler, released_schedule
from headmoe.pipeline.seeding import seeded_generator
from headmoe.pipeline.stop import LayerGate, streams_layers


@dataclass(frozen=True, kw_only=True)
class GenerateJob:
    """Everything a rank needs (picklable: it travels to spawned ranks): the `Deployment`
    (model, layout, release, timeout, layer streaming), the admitted request (its
    `GenerateRequest` and 1080p `RefinerStage`), the output and the I2V image.

    ``output`` None computes and returns the hashes without writing files. ``components``
    is the factory that builds the job's components on each rank (a module-level function:
    the job travels to spawned ranks); the entry points pass
    `headmoe.release.components.magi2_components`, tests their own; None only for jobs whose
    components are handed to `denoise` directly."""

    deployment: Deployment
    request: GenerateRequest
    output: str | None
    image: ReferenceImage | None = None
    """Image-to-video: the `headmoe.pipeline.image.ReferenceImage` of the first frame (its
    pixels needed on rank `placement.IMAGE_RANK` only), or None (text-to-video)."""
    refiner: RefinerStage | None = None
    """The 1080p refiner stage (the release's ``refiner/`` runs it after the preview);
    None: the preview is the output."""
    extra: dict[str, object] = field(default_factory=dict)
    """Free-form facts recorded in the sidecar (for example the launch command)."""
    progress: bool = True
    check_layers: bool = False
    """Check every transformer layer's output for NaN/Inf (``--debug``)."""
    overwrite: bool = False
    """Replace existing output files; without it an output that appears while the job runs
    (another run's) is kept and the job fails (`headmoe.files.atomic_write`)."""
    components: Callable[[ParallelContext, GenerateJob], Components] | None = None

    # the deployment's fields the ranks read, by their old names
    @property
    def parallel(self) -> ParallelConfig:
        return self.deployment.parallel

    @property
    def model_config(self) -> Magi2Config:
        return self.deployment.model_config

    @property
    def checkpoint(self) -> str:
        return self.deployment.checkpoint

    @property
    def release(self) -> ReleaseFolder | None:
        return self.deployment.release

    @property
    def timeout_s(self) -> float:
        return self.deployment.timeout_s

    @property
    def offload_layers(self) -> bool:
        return self.deployment.offload_layers

    @property
    def resident_layers(self) -> int:
        return self.deployment.resident_layers

    @property
    def expert_format(self) -> str:
        return self.deployment.expert_format


def encode_prompts(
    encoder: TextEncoder, prompts: Sequence[str], device: torch.device
) -> tuple[list[torch.Tensor], list[TextTokens] | None]:
    """Features ``[L_i, C]`` of each prompt on ``device`` and, when the encoder reports
    them (``encode_with_report``), the token counts ``{"tokens", "kept", "truncated"}``."""
    report = getattr(encoder, "encode_with_report", None)
    if report is None:
        return [encoder.encode(p).to(device) for p in prompts], None
    pairs = [report(p) for p in prompts]
    return [f.to(device) for f, _ in pairs], [r for _, r in pairs]


def output_path(output: str | os.PathLike[str], dp_index: int, dp_size: int) -> Path:
    """``output`` for one DP group, ``<stem>.dp<k><suffix>`` for group k of several."""
    p = Path(output)
    return p if dp_size == 1 else p.with_name(f"{p.stem}.dp{dp_index}{p.suffix}")


# ---------------------------------------------------------------------- the job
class JobResult(TypedDict):
    """What `run_job` returns on each rank (the hashes, output and sidecar: None off the
    DP group's writer; output and sidecar None without an output path)."""

    rank: int
    dp_index: int
    seed: int
    video_sha256: str | None
    audio_sha256: str | None
    output: str | None
    sidecar: str | None
    step_times_s: list[float]


class RankInfo(TypedDict):
    """One rank's facts for the sidecar, all-gathered after the steps (`_gather_infos`)."""

    rank: int
    dp: int
    step_times_s: list[float]
    refine_step_times_s: list[float] | None
    counters: dict[str, object]
    text_encoder_runs: int | None


def run_job(ctx: ParallelContext, job: GenerateJob) -> JobResult:
    """Run ``job`` on this rank of ``ctx`` (every rank of the world calls it together).

    Returns ``{"rank", "dp_index", "seed", "video_sha256", "audio_sha256", "output",
    "sidecar", "step_times_s"}``; the hashes are those of the decoded uint8 frames
    ``[F, H, W, 3]`` and int16 audio ``[channels, samples]`` on the DP group's writer, None
    on other ranks. Bad inputs raise `ValueError` before any collective. Equivalent to
    `run_request` over `build_components` (whose time counts in the sidecar's ``total_s``).

    With streamed layers (`--offload-layers`) a rank whose layer read fails (the checkpoint
    changed) stops every rank before that layer (`headmoe.pipeline.stop.LayerGate`)."""
    t_start = time.perf_counter()
    parts = build_components(ctx, job)
    gate = LayerGate(parts, ctx.device) if streams_layers(parts) else contextlib.nullcontext()
    with gate:
        return run_request(ctx, job, parts, t_start=t_start)


def run_loaded(ctx: ParallelContext, jobs: Sequence[GenerateJob]) -> list[JobResult]:
    """Several jobs on one model load (``generate --samples``; every rank calls it with the
    same jobs, of one deployment and one dtype): the components built once from the first
    job, with the first refiner stage any job has (so the refiner loads when one runs it),
    then `run_request` for each job in order, counters reset before each; `run_job`'s
    results, one per job. Each job's bytes are those of a `run_job` of it alone."""
    t_start = time.perf_counter()
    dtypes = {job.request.dtype for job in jobs}
    if len(dtypes) != 1:
        raise ValueError(f"jobs on one model load need one dtype, got {sorted(dtypes)}")
    stage = next((job.refiner for job in jobs if job.refiner is not None), None)
    parts = build_components(ctx, dataclasses.replace(jobs[0], refiner=stage))
    gate = LayerGate(parts, ctx.device) if streams_layers(parts) else contextlib.nullcontext()
    results = []
    with gate:  # as `run_job`'s
        for i, job in enumerate(jobs):
            ctx.counters.reset()
            results.append(run_request(ctx, job, parts, t_start=t_start if i == 0 else None))
    return results


def build_components(ctx: ParallelContext, job: GenerateJob) -> Components:
    """The components ``job`` runs with, built by its factory ``job.components``: built
    once, they serve any number of `run_request` calls of the same model, layout and
    dtype."""
    require_reproducible_blas()  # the same on every rank, before any collective
    if job.components is None:
        raise ValueError("job.components is None: a job that runs needs a component factory "
                         "(the entry points pass headmoe.release.components.magi2_components)")
    return job.components(ctx, job)


@dataclass
class Noise:
    """The initial latents of one request on one rank: video ``[T_lat, H_lat, W_lat, C_v]``
    and audio ``[T_audio, C_a]`` fp32 on the rank's device, from one generator seeded with
    ``seed`` (video drawn first, in the release's ``[1, C_v, T, H, W]`` layout)."""

    seed: int
    video: torch.Tensor
    audio: torch.Tensor
    num_samples: int
    generator: torch.Generator | None = None
    """The request's generator after these draws (the refiner's noise is its next draw)."""


def noise_generator(seed: int, device: str, ctx_device: torch.device) -> torch.Generator:
    """The generator of the noise: every bit of ``seed`` on the CPU (`seeded_generator`),
    or the CUDA generator of the rank's device seeded with ``seed`` (``device="cuda"``,
    the reference's draw: its values depend on the GPU model)."""
    if device == "cpu":
        return seeded_generator(seed)
    if ctx_device.type != "cuda":
        raise ValueError(f"noise_device='cuda' needs ranks on CUDA devices, this rank runs "
                         f"on {ctx_device}")
    return torch.Generator(device=ctx_device).manual_seed(seed)


def draw_noise(ctx: ParallelContext, req: GenerateRequest, parts: Components) -> Noise:
    """Step 1: the noise of DP group ``coords.dp`` (seed ``req.seed + dp``), drawn as the
    release draws it: ``randn(1, C_v, T, H, W)`` then ``randn(1, T_audio, C_a)``."""
    t, h, w = parts.video_decoder.latent_shape(req.num_frames, req.height, req.width)
    t_audio = parts.audio_decoder.latent_length(req.duration_s)
    seed = req.seed + ctx.coords.dp
    gen = noise_generator(seed, req.noise_device, ctx.device)
    dev = gen.device
    xv = torch.randn((1, parts.video_decoder.latent_channels, t, h, w), generator=gen,
                     device=dev)
    xa = torch.randn((1, t_audio, parts.audio_decoder.latent_channels), generator=gen,
                     device=dev)
    noise = Noise(seed, xv[0].permute(1, 2, 3, 0).contiguous().to(ctx.device),
                  xa[0].to(ctx.device), req.audio_samples(parts.audio_decoder.sample_rate), gen)
    if req.noise_device != "cpu" and ctx.world_size > 1:
        digest = tensor_sha256(torch.cat([noise.video.reshape(-1), noise.audio.reshape(-1)]))
        infos: list[tuple[int, str] | None] = [None] * ctx.world_size
        dist.all_gather_object(infos, (ctx.coords.dp, digest))
        check_same_noise(cast(list[tuple[int, str]], infos), req.noise_device)  # all filled
    return noise


def check_same_noise(digests: Sequence[tuple[int, str]], noise_device: str) -> None:
    """``digests[rank] = (dp index, noise digest)``: raise `ValueError` naming the ranks
    whose noise differs from their DP group's first rank (GPUs of different models draw
    different values on the CUDA generator)."""
    first: dict[int, tuple[int, str]] = {}
    for rank, (dp, digest) in enumerate(digests):
        ref = first.setdefault(dp, (rank, digest))
        if ref[1] != digest:
            raise ValueError(
                f"noise_device={noise_device!r}: rank {rank} drew other noise than rank "
                f"{ref[0]} of the same request (the values of a GPU generator depend on the "
                f"GPU model); run the job on one GPU model or use noise_device='cpu'")


def _predict(ctx: ParallelContext, parts: Components, xv: torch.Tensor, xa: torch.Tensor,
             texts: list[torch.Tensor], tau: float, cond: ImageCondition | None = None,
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(cond video, cond audio), (uncond video, uncond audio)] at model time ``tau``:
    both branches packed in one forward (CFG1), or this rank's branch and one all-gather of
    the predictions over the CFG group (CFG2). ``cond``: the image rows both branches carry."""
    mine = [0, 1] if ctx.topology.cfg == 1 else [ctx.coords.cfg]
    extra = cond.branch_fields() if cond is not None else {}
    preds = parts.denoiser([BranchInput(xv, xa, texts[b], tau, tau, **extra) for b in mine])
    if ctx.topology.cfg == 1:
        return preds
    flat = torch.cat([preds[0][0].reshape(-1), preds[0][1].reshape(-1)])
    got = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(got, flat, group=ctx.group("cfg"))
    nv = xv.numel()
    return [(g[:nv].view_as(xv), g[nv:].view_as(xa)) for g in got]


def denoise(
    ctx: ParallelContext, job: GenerateJob, parts: Components, noise: Noise,
    texts: list[torch.Tensor], on_step: Callable[[int, int], None] | None = None,
    cond: ImageCondition | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Step 2: the sampler loop; returns the final video and audio latents and the step
    times (s). Every rank combines the same predictions with the same arithmetic. ``cond``:
    image-to-video's image rows (`headmoe.pipeline.i2v.image_condition`)."""
    req = job.request
    schedule = released_schedule(req.num_inference_steps, req.shift)
    samp_v, samp_a = make_sampler(req.sampler, schedule), make_sampler(req.sampler, schedule)
    xv, xa, step_times = noise.video, noise.audio, []
    bar = tqdm(total=req.num_inference_steps, desc="denoising", unit="step",
               disable=not (job.progress and ctx.rank == 0))
    for i in range(req.num_inference_steps):
        t0 = time.perf_counter()
        note_step(i)
        preds = _predict(ctx, parts, xv, xa, texts, schedule.model_time(i), cond)
        check_step(i, req.num_inference_steps, preds, schedule.sigma(i))  # same on every rank
        (vc, ac), (vu, au) = preds
        xv = samp_v.step(i, xv, cfg_combine(vc, vu, req.guidance_scale))
        xa = samp_a.step(i, xa, cfg_combine(ac, au, req.audio_guidance_scale))
        step_times.append(time.perf_counter() - t0)
        bar.update(1)
        if on_step is not None:
            on_step(i + 1, req.num_inference_steps)
    bar.close()
    return xv, xa, step_times


def refine(
    ctx: ParallelContext, job: GenerateJob, parts: Components, noise: Noise, xv: torch.Tensor,
    texts: list[torch.Tensor], on_step: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Step 2b (1080p): the refiner stage on the preview's final video latent; returns the
    refined latent ``[2T - 1, H', W', C]`` and the step times, with a progress bar like the
    preview's. ``on_step`` sees the steps of both stages counted together (a server's job
    progress)."""
    # called for a job with a refiner stage, whose components hold the refiner
    stage, n = cast(RefinerStage, job.refiner), job.request.num_inference_steps
    refiner, generator = cast(Refiner, parts.refiner), cast(torch.Generator, noise.generator)
    total = n + stage.steps
    bar = tqdm(total=stage.steps, desc=f"refining {stage.width}x{stage.height}", unit="step",
               disable=not (job.progress and ctx.rank == 0))

    def step(done: int, _: int) -> None:
        bar.update(1)
        if on_step is not None:
            on_step(n + done, total)

    try:
        with refiner.active() as model:
            return refine_stage(ctx, model, xv, texts, generator, stage.height,
                                stage.width, stage.steps, step)
    finally:
        bar.close()


def refiner_record(stage: RefinerStage, latent: torch.Tensor, infos: list[RankInfo], dp: int
                   ) -> dict[str, object]:
    """The sidecar's ``refiner`` object: the stage's fields, its latent shape and every
    rank's refiner step times."""
    per_rank = {str(x["rank"]): cast(list[float], x["refine_step_times_s"])  # every rank refined
                for x in infos if x["dp"] == dp}
    return {**stage.to_dict(), "latent": list(latent.shape),
            "step_times_s": {"per_rank": per_rank,
                             "max": [max(ts) for ts in zip(*per_rank.values())]}}


def _gather_infos(ctx: ParallelContext, step_times: list[float],
                  refine_times: list[float] | None = None,
                  text_runs: int | None = None) -> list[RankInfo]:  # fmt: skip
    """Every rank's step times (preview and refiner), counters and text-encoder runs (None:
    the encoder does not count them), in one all-gather of small host objects."""
    mine: RankInfo = {"rank": ctx.rank, "dp": ctx.coords.dp, "step_times_s": step_times,
                      "refine_step_times_s": refine_times, "counters": ctx.counters.summary(),
                      "text_encoder_runs": text_runs}
    if ctx.world_size == 1:
        return [mine]
    infos: list[RankInfo | None] = [None] * ctx.world_size
    dist.all_gather_object(infos, mine)
    return cast(list[RankInfo], infos)  # every rank's slot filled


def decode(parts: Components, req: GenerateRequest, xv: torch.Tensor, xa: torch.Tensor,
           num_samples: int, num_frames: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3 (the writer rank): uint8 frames ``[F, H, W, 3]`` (F = ``num_frames``, default
    the request's) and int16 audio ``[channels, samples]``, with the numerical-health checks
    around the decoders."""
    check_media("before decoding", **{"video latents": xv, "audio latents": xa})
    frames = parts.video_decoder.decode(xv.float().cpu(), num_frames or req.num_frames)
    wave = parts.audio_decoder.decode(xa.float().cpu(), num_samples)
    check_media("after decoding", DECODER_HINT, **{"audio waveform": wave})
    return frames, quantize_audio(wave)


@reproducible_blas()  # the text encoder and decoders too (headmoe.numerics)
def run_request(
    ctx: ParallelContext,
    job: GenerateJob,
    parts: Components,
    *,
    on_step: Callable[[int, int], None] | None = None,
    t_start: float | None = None,
) -> JobResult:
    """`run_job` with prebuilt ``parts`` (see `build_components`). ``on_step(done, total)``
    runs on every rank after each denoising step; whatever it raises aborts the request
    before anything is written (for cancellation it must decide the same on every rank).
    ``t_start`` (a `time.perf_counter` value, default now) starts the sidecar's ``total_s``."""
    t_start = time.perf_counter() if t_start is None else t_start
    req, coords = job.request, ctx.coords
    noise = draw_noise(ctx, req, parts)
    prompt = req.prompt if job.image is None else ensure_figure_token(req.prompt)
    prompts = (prompt, req.negative_prompt)
    texts, text_counts = encode_prompts(parts.text_encoder, prompts, ctx.device)
    text_info = text_report(parts.text_encoder, prompts, texts, text_counts)
    cond = None if job.image is None else image_condition(
        parts, job.image, prompt, texts[0], req.torch_dtype)
    xv, xa, step_times = denoise(ctx, job, parts, noise, texts, on_step, cond)
    refine_times, num_frames, fps = None, req.num_frames, req.fps
    if job.refiner is not None:
        xv, refine_times = refine(ctx, job, parts, noise, xv, texts, on_step)
        num_frames, fps = frame_count(xv.shape[0]), req.fps * REFINER_FPS_FACTOR
    infos = _gather_infos(ctx, step_times, refine_times,
                          getattr(parts.text_encoder, "runs", None))
    result: JobResult = {
        "rank": ctx.rank, "dp_index": coords.dp, "seed": noise.seed, "video_sha256": None,
        "audio_sha256": None, "output": None, "sidecar": None, "step_times_s": step_times}
    if not is_output_coords(coords):
        return result
    frames, audio = decode(parts, req, xv, xa, noise.num_samples, num_frames)
    warn_truncated(text_info)
    result["video_sha256"], result["audio_sha256"] = tensor_sha256(frames), tensor_sha256(audio)
    if job.output is None:
        return result
    out = output_path(job.output, coords.dp, ctx.topology.dp)
    text = {**text_info, "text": None if text_counts is None else {
        "prompt": text_counts[0], "negative_prompt": text_counts[1],
        "max_tokens": getattr(parts.text_encoder, "max_tokens", None)}}
    side = _sidecar(ctx, job, parts, noise, frames, audio, infos, text, result)
    if job.refiner is not None:
        side["refiner"] = refiner_record(job.refiner, xv, infos, coords.dp)
        cast(dict[str, object], side["media"])["fps"] = fps
    write_outputs(out, side, frames, audio, fps, parts.audio_decoder.sample_rate, t_start,
                  overwrite=job.overwrite)
    result["output"], result["sidecar"] = str(out), str(sidecar_path(out))
    return result


def _sidecar(ctx: ParallelContext, job: GenerateJob, parts: Components, noise: Noise,
             frames: torch.Tensor, audio: torch.Tensor, infos: list[RankInfo],
             text: dict[str, object], result: JobResult) -> dict[str, object]:
    """The JSON sidecar of one DP group's output (docs/pipeline.md lists the fields)."""
    req, topo, coords = job.request, ctx.topology, ctx.coords
    group = [x for x in infos if x["dp"] == coords.dp]
    per_rank = {str(x["rank"]): x["step_times_s"] for x in group}
    release = job.release.describe() if job.release is not None else {}
    return {
        "request": req.to_dict(),
        "seed": noise.seed,
        **{k: v for k, v in text.items() if k != "text"},
        "model": {"name": getattr(job.model_config, "name", None),
                  "checkpoint": job.checkpoint, **release, "expert_format": job.expert_format},
        "text": text["text"],
        "layout": {**job.parallel.to_dict(), "world_size": ctx.world_size,
                   "resolved_expert_parallel_size": topo.expert_parallel_size,
                   "ep_replicas": topo.ep_replicas, "dp_index": coords.dp,
                   "offload_layers": job.offload_layers, "resident_layers": job.resident_layers,
                   "cuda_graphs": job.deployment.cuda_graphs,
                   "ranks": [x["rank"] for x in group]},
        "latents": {"video": list(noise.video.shape), "audio": list(noise.audio.shape)},
        "image": None if job.image is None else {
            **job.image.describe(), "prompt": ensure_figure_token(req.prompt)},
        "media": {"frames": list(frames.shape), "fps": req.fps,
                  "audio_samples": list(audio.shape),
                  "sample_rate": parts.audio_decoder.sample_rate},
        "step_times_s": {"per_rank": per_rank,
                         "max": [max(ts) for ts in zip(*per_rank.values())]},
        "total_s": None,  # set once the mp4 is written
        "video_sha256": result["video_sha256"],
        "audio_sha256": result["audio_sha256"],
        "counters": {str(x["rank"]): x["counters"] for x in group},
        "text_encoder_runs": {str(x["rank"]): x["text_encoder_runs"] for x in infos},
        "torch": torch.__version__,
        "numerics": numerics_record(),
        **job.extra,
    }


def write_outputs(out: Path, side: dict[str, object], frames: torch.Tensor, audio: torch.Tensor,
                  fps: float, sample_rate: int, t_start: float, *,
                  overwrite: bool = False) -> None:
    """Step 4: the mp4 and its sidecar, each atomically; neither file of this run stays if
    the sidecar cannot be written (with ``overwrite`` nor an older sidecar that no longer
    matches; without it neither file may exist: another run's files are never touched)."""
    write_mp4(out, frames, fps, audio, sample_rate, overwrite=overwrite)
    side["total_s"] = time.perf_counter() - t_start
    try:
        write_sidecar(sidecar_path(out), side, overwrite=overwrite)
    except BaseException:
        out.unlink()
        if overwrite:
            sidecar_path(out).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------- rank entry points
_T = TypeVar("_T")


def launched_rank(job: GenerateJob) -> JobResult:
    """Entry point of a rank started by `launch_local` or torchrun: joins the world from
    the environment (Gloo on CPU, NCCL on GPU with device LOCAL_RANK; on CPU
    `set_rank_threads`: the available cores // LOCAL_WORLD_SIZE torch threads), with
    ``job.timeout_s`` bounding every collective, runs `run_job` and tears the groups down."""
    return _launched(job, lambda ctx: run_job(ctx, job))


def launched_samples(jobs: Sequence[GenerateJob]) -> list[JobResult]:
    """`launched_rank` of several jobs on one model load (`run_loaded`)."""
    return _launched(jobs[0], lambda ctx: run_loaded(ctx, jobs))


def _launched(job: GenerateJob, run: Callable[[ParallelContext], _T]) -> _T:
    """Join the world as `launched_rank` says (``job``'s layout and timeout), ``run`` it
    (with the hung-peer heartbeat) and tear the groups down."""
    env = torchrun_env()
    if env is None:
        raise ValueError("launched_rank needs RANK, WORLD_SIZE and LOCAL_RANK (torchrun)")
    interrupt_once()
    set_rank_threads(env.local_world_size)  # on CUDA `initialize` makes cuda:LOCAL_RANK current
    ctx = ParallelContext.initialize(job.parallel, timeout=timedelta(seconds=job.timeout_s))
    store = dist.distributed_c10d._get_default_store() if ctx.world_size > 1 else None
    try:
        if store is None:
            return run(ctx)
        with Heartbeat(store, ctx.rank, ctx.world_size) as beat:
            try:
                return run(ctx)
            except Exception as exc:  # a hung peer: name it (see headmoe.distributed.watchdog)
                raise beat.explain(exc, job.timeout_s, job.request.num_inference_steps) from exc
    finally:
        ctx.destroy()


def run_jobs(rank: int, world_size: int, jobs: Sequence[GenerateJob]) -> list[JobResult]:
    """`run_ranks` entry: run ``jobs`` one after another on an initialised default group
    (each job's layout must span ``world_size`` ranks); returns `run_job`'s results."""
    results = []
    for job in jobs:
        ctx = ParallelContext.initialize(job.parallel, timeout=timedelta(seconds=job.timeout_s))
        try:
            results.append(run_job(ctx, job))
        finally:
            ctx.destroy()
    return results
