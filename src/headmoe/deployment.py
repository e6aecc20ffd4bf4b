"""`build_deployment`: the one function from the user's options to the `Deployment` every
request of a command is admitted on (`headmoe.admission.admit`) and runs on.

    opts = DeploymentOptions(model="tiny", parallel=ParallelConfig(ulysses_degree=2))
    dep = build_deployment(opts)          # layout, world, release headers, budget checked
    admitted = admit({"prompt": "a fox"}, dep)

Its layer sits between the planner and admission: it reads the release folder (or a
checkpoint's config), checks the layout against the world and the model, and sizes the
per-rank memory budget (`memory_budget`) and the CPU threads. ``generate``, ``serve`` and
``compare`` call it once; the options come from the flags (`headmoe.cli.flags`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from headmoe.config import GIB, ParallelConfig, is_number
from headmoe.distributed.context import rank_device, rank_threads
from headmoe.distributed.launch import torchrun_env
from headmoe.distributed.topology import plan_topology
from headmoe.errors import UserError
from headmoe.layers.cuda_graphs import check_cuda_graphs
from headmoe.layers.flash_attention import resolve_attention
from headmoe.models.magi2 import Magi2Config, get_config, validate_parallel
from headmoe.models.magi2.config import PRESETS
from headmoe.models.magi2.loading import stored_expert_format
from headmoe.models.refiner import get_refiner_config
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT, check_expert_format, resolve_format
from headmoe.pipeline.deployment import UNCHECKED, Budget, Deployment, check_timeout
from headmoe.planner.memory import StreamSettings, memory_limit
from headmoe.planner.time import STEP_TIMES_FILE
from headmoe.release import folder as rel
from headmoe.release.components import resolve_model
from headmoe.release.text_encoder import TokenCounter

#: the largest memory budget a flag may give (GiB per rank)
MAX_BUDGET_GIB = 1 << 20
#: the refiner configuration ``plan`` prices (the release's refiner/)
PLANNED_REFINER = "magi2-refiner"


@dataclass(frozen=True, kw_only=True)
class DeploymentOptions:
    """The user's options that decide a `Deployment` (each set by one flag of
    `headmoe.cli.flags`, whose ``dest`` is the field's name)."""

    model: str = "tiny"
    """'tiny', a release folder or a transformer checkpoint file."""
    model_config: str | None = None
    cache_dir: str = "~/.cache/headmoe"
    video_decoder: str | None = None
    offload: bool = False
    image_encoder: bool | None = False
    """True: the request has an image (vae/ required); None: a server uses vae/ when
    present; False: left out."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    nproc: int | None = None
    timeout: float = 60.0
    offload_layers: bool = False
    resident_layers: int = 0
    expert_format: str | None = None
    """The routed experts' format (`headmoe.moe.formats.EXPERT_FORMATS`); None: the
    checkpoint's own (a plan or a configuration: "bf16")."""
    attention: str = "auto"
    """``--attention`` (`headmoe.layers.flash_attention.resolve_attention`)."""
    cuda_graphs: bool = False
    """``--cuda-graphs`` (`headmoe.layers.cuda_graphs.check_cuda_graphs`)."""
    max_memory_gib: float | None = None
    """The per-rank budget in GiB (None: the detected limit; 0: no check)."""
    budget_flag: str = "--max-memory-gib"
    """The flag that gives ``max_memory_gib``, for messages."""
    max_time: float | None = None
    server: bool = False
    """A server: the release's refiner/ loads at start and stays (every request counts its
    weights) and every request runs in ``dtype`` (None: the recipe's on this device)."""
    dtype: str | None = None
    config_only: bool = False
    """Read the model's configuration only (``compare``: no world, no budget, no weight
    header; each run's own ``generate`` checks those)."""
    plan: bool = False
    """A plan (``plan``, `plan_deployment`): the configuration only, on GPUs, with the
    budget, the streaming and the refiner the planner prices; no world, no weight header."""


def build_deployment(opts: DeploymentOptions) -> Deployment:
    """The `Deployment` of ``opts``: the world (`check_world`), the collective timeout, the
    layer streaming, the model (a release folder's every header checked, the tiny release
    written once, or a checkpoint's config) against the layout, the device ranks use, the
    memory budget, the text encoder's token count. Raises `ValueError` (field names or
    flags) before any weight is read."""
    if opts.config_only:
        return Deployment(model_config=model_config_of(opts), model=opts.model,
                          parallel=opts.parallel,
                          expert_format=opts.expert_format or DEFAULT_EXPERT_FORMAT)
    if opts.plan:
        return plan_deployment(opts)
    world = check_world(opts.nproc, opts.parallel)
    check_timeout(opts.timeout)
    if opts.model == "tiny" or rel.is_release_folder(opts.model):
        release = read_release(opts)
        model_config, checkpoint = release.model_config, release.transformer
        stored = release.expert_format
    else:
        release = None
        for name in ("video_decoder", "offload"):
            if getattr(opts, name):
                raise ValueError(f"{name} applies to a release folder, not to "
                                 f"model={opts.model!r}")
        model_config, checkpoint = resolve_model(opts.model, opts.cache_dir, opts.model_config,
                                                 write=False)
        validate_parallel(model_config, opts.parallel)
        stored = stored_expert_format(checkpoint)
    expert_format = check_expert_stream(opts, stored, checkpoint)
    device = rank_device().type
    attention = resolve_attention(opts.attention, device, opts.cache_dir)
    check_cuda_graphs(opts.cuda_graphs, device, opts.offload_layers, world)
    ranks = local_ranks(world)
    budget = memory_budget(opts.max_memory_gib, opts.budget_flag, ranks, device)
    check_stream(opts.offload_layers, opts.resident_layers, model_config.num_layers)
    dep = Deployment(
        model_config=model_config, checkpoint=checkpoint, model=opts.model, release=release,
        parallel=opts.parallel, device=device, budget=budget,
        count_tokens=None if release is None else TokenCounter(release.text_encoder),
        describe=f"--model {opts.model} (config {getattr(model_config, 'name', '?')})",
        offload=opts.offload, offload_layers=opts.offload_layers,
        resident_layers=opts.resident_layers, expert_format=expert_format,
        refiner_config=None if release is None else release.refiner_config,
        refiner_problem="" if release is None else release.refiner_problem or "",
        threads=rank_threads(ranks), max_time_s=check_max_time(opts.max_time),
        step_cache=str(Path(opts.cache_dir).expanduser() / STEP_TIMES_FILE),
        timeout_s=opts.timeout, attention=attention, cuda_graphs=opts.cuda_graphs)
    if not opts.server:
        return dep
    return dataclasses.replace(dep, resident_refiner=dep.has_refiner,
                               dtype=opts.dtype or dep.recipe.default("dtype", device))


def plan_deployment(opts: DeploymentOptions) -> Deployment:
    """The `Deployment` ``plan`` sizes layouts on: the model's configuration (a preset of any
    size, or `model_config_of`'s), "cuda" ranks (the recipe's GPU defaults), the
    budget of ``max_memory_gib`` (0: no limit), the layer streaming, ``offload`` and the
    released refiner's configuration (the refiner stage it prices). Nothing is read but
    configuration files and, for a release folder, its transformer's tensor names (the
    experts' stored format: ``expert_format`` left out plans that format, and
    `check_expert_stream` refuses what ``generate`` would; a preset plans bf16 unless
    told)."""
    model_config = get_config(opts.model) if opts.model in PRESETS else model_config_of(opts)
    check_stream(opts.offload_layers, opts.resident_layers, model_config.num_layers)
    folder = opts.model not in PRESETS and rel.is_release_folder(opts.model)
    checkpoint = rel.transformer_file(Path(opts.model).expanduser()) if folder else None
    expert_format = check_expert_format(opts.expert_format or DEFAULT_EXPERT_FORMAT) \
        if checkpoint is None else check_expert_stream(
            opts, stored_expert_format(checkpoint), checkpoint)
    return Deployment(
        model_config=model_config, model=opts.model, parallel=opts.parallel, device="cuda",
        budget=memory_budget(opts.max_memory_gib, opts.budget_flag, 1, "cuda"),
        describe=f"--model {opts.model} (config {model_config.name})", offload=opts.offload,
        offload_layers=opts.offload_layers, resident_layers=opts.resident_layers,
        expert_format=expert_format, refiner_config=get_refiner_config(PLANNED_REFINER))


def check_expert_stream(opts: DeploymentOptions, stored: str, checkpoint: str) -> str:
    """The expert format the ranks run in: ``opts.expert_format`` against the checkpoint's
    stored one (`resolve_format`: an FP8 checkpoint refuses "bf16"). Layer streaming
    copies the stored bytes each step, so ``--offload-layers`` with FP8 experts needs an
    FP8 checkpoint (``headmoe quantize``): quantizing every streamed layer every step is
    refused, naming both fields."""
    fmt = resolve_format(opts.expert_format, stored, f"the checkpoint {checkpoint!r}")
    if opts.offload_layers and fmt != stored:
        raise ValueError(f"offload_layers streams the checkpoint's stored bytes, and "
                         f"{checkpoint!r} stores bf16 experts: expert_format={fmt!r} with "
                         "offload_layers needs an FP8 release folder (write one with "
                         "'headmoe quantize --model RELEASE --output DIR'); without "
                         "offload_layers the experts are quantized on load")
    return fmt


def model_config_of(opts: DeploymentOptions) -> Magi2Config:
    """The transformer configuration ``model`` / ``model_config`` give, reading no weight:
    the tiny preset, a release folder's (`release_config`) or a checkpoint's."""
    if opts.model != "tiny" and rel.is_release_folder(opts.model):
        return rel.release_config(Path(opts.model).expanduser(), opts.model_config)
    return resolve_model(opts.model, opts.cache_dir, opts.model_config, write=False)[0]


def read_release(opts: DeploymentOptions) -> rel.Release:
    """The checked `Release` of ``opts.model`` ('tiny': the embedded folder, written once
    after the cheap checks pass; a folder without preview/config.json is read as MAGI-2
    Preview, ``model_config`` supplies or replaces its configuration), the layout checked
    against its model. Raises `ValueError` naming the field, file or tensor."""
    video = opts.video_decoder or "turbo"
    if opts.model == "tiny":
        if opts.model_config is not None:
            raise ValueError("model_config applies to a release folder or a checkpoint file, "
                             "not to the embedded model='tiny'")
        validate_parallel(get_config("tiny"), opts.parallel)
        found = rel.find_release(rel.tiny_release(opts.cache_dir), video, opts.offload,
                                 opts.image_encoder)
        found = dataclasses.replace(
            found, model_config=dataclasses.replace(found.model_config, name="tiny"))
    else:
        found = rel.find_release(opts.model, video, opts.offload, opts.image_encoder,
                                 opts.model_config)
        validate_parallel(found.model_config, opts.parallel)
    found = rel.check_release(found)  # headers only, before any rank starts
    unused = rel.unused_entries(found)
    if unused and opts.model != "tiny":  # the embedded folder has the release's, by design
        print(f"headmoe: warning: {len(unused)} component entries headmoe does not use (nor "
              "does the reference), listed in the sidecar's release.unused_entries",
              file=sys.stderr)
    return dataclasses.replace(found, unused=tuple(unused))


def check_world(nproc: int | None, parallel: ParallelConfig) -> int:
    """The world size: torchrun's, else ``nproc``, else the layout's; it must be the
    layout's (`plan_topology` checks the rest). Raises `ValueError` naming the flags."""
    env = torchrun_env()
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be a positive number of ranks, got {nproc}")
    if env is not None and nproc is not None and nproc != env.world_size:
        raise ValueError(
            f"--nproc {nproc} does not match the torchrun world of {env.world_size} "
            "ranks (leave --nproc out under torchrun)"
        )
    world = env.world_size if env is not None else (nproc or parallel.world_size)
    if world != parallel.world_size:
        raise ValueError(
            f"{'the torchrun world' if env else '--nproc'} has {world} ranks but the "
            f"layout needs --ulysses-degree {parallel.ulysses_degree} x --cfg-parallel-size "
            f"{parallel.cfg_parallel_size} x --data-parallel-size "
            f"{parallel.data_parallel_size} = {parallel.world_size}"
        )
    plan_topology(world, parallel)
    return world


def check_stream(offload_layers: bool, resident_layers: int, num_layers: int
                 ) -> StreamSettings | None:
    """The `StreamSettings` of ``--offload-layers`` / ``--resident-layers`` (None without
    streaming); `UserError` naming the flag for a bad value."""
    if not offload_layers:
        if resident_layers:
            raise UserError(f"--resident-layers {resident_layers} needs --offload-layers")
        return None
    if not 0 <= resident_layers <= num_layers:
        raise UserError(f"--resident-layers must be in [0, {num_layers}] (the model's "
                        f"layers), got {resident_layers}")
    return StreamSettings(resident_layers)


def stream_of(dep: Deployment) -> StreamSettings | None:
    """The `StreamSettings` of a deployment that streams its layers (None: it does not)."""
    if not dep.offload_layers:
        return None
    return check_stream(True, dep.resident_layers, dep.model_config.num_layers)


def check_max_time(value: float | None) -> float | None:
    """``--max-time`` as seconds or None (0: no check); `UserError` naming the flag."""
    if value is None or value == 0:
        return None
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"--max-time must be a positive number of seconds (0: no check), got "
                        f"{value!r}")
    return value


def memory_budget(gib: float | None, flag: str, local_ranks: int, device: str) -> Budget:
    """The per-rank budget: ``gib`` GiB when given (``flag`` names it in messages; 0 means
    no check), else `memory_limit` (free device memory, or the host's available memory /
    local ranks). Raises `ValueError` naming ``flag``."""
    if gib is not None:
        if not (is_number(gib) and math.isfinite(gib) and 0 <= gib <= MAX_BUDGET_GIB):
            raise ValueError(f"{flag} must be a number of GiB in [0, {MAX_BUDGET_GIB:,}] "
                             f"(0: no check), got {gib!r}")
        return UNCHECKED if gib == 0 else Budget(int(gib * GIB), flag)
    limit, source = memory_limit(local_ranks, device == "cuda")
    return Budget(limit, source)


def local_ranks(world: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else the whole local world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))
