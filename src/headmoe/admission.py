"""Admission: the one path from a request + a deployment to a checked, resolved request.

    dep = build_deployment(DeploymentOptions(model="tiny"))  # headmoe.deployment
    admitted = admit({"prompt": "a fox", "resolution": "272p", "seconds": 4}, dep)
    admitted.request            # GenerateRequest, every field filled
    admitted.sources            # field -> "flag" / "request" / "model default"

``generate``, ``serve``, ``compare`` and ``plan`` all call `admit` (``plan`` with a
placeholder prompt and its own token counts); a refusal is a `Refusal` carrying the field, the value
and a one-line message in field names, so every entry point gives the same verdict (the
command line shows the fields as flags, the HTTP API returns the field as ``param``).

What it owns, in the order it checks:

1. the fields a request may give (`INPUT_FIELDS`) and each one's rule
   (`headmoe.pipeline.request.check_field`; ``resolution`` one of the presets, ``1080p``
   only with the refiner; ``seconds`` a number or a numeric string in (0, 80]; ``size``
   ``"WxH"``);
2. contradictions between fields (``resolution`` / ``size`` / ``height`` + ``width``;
   ``seconds`` / ``num_frames``): refused naming both;
3. the defaults of the model's recipe (`headmoe.pipeline.recipe.recipe_for`);
4. frame geometry from the decoders' rule (`headmoe.pipeline.latents.latent_shape`:
   ``num_frames = 4k+1``, sides multiples of 16) and at least one audio sample;
5. the seed range of the job (data-parallel group k uses seed + k, all below 2**63);
6. the text tokens of both prompts, counted by the deployment's tokenizer (the release's,
   capped at its 7,000-token limit), for
7. the one memory estimate (`headmoe.planner.memory.estimate_memory`, the routed experts
   counted in the deployment's ``expert_format``) against the one budget
   (`headmoe.deployment.memory_budget`, the `Deployment`'s).

The expert format needs no device check, by design: FP8 experts (``expert_format="fp8"``)
are W8A16 (bf16 activations, FP8 weights widened to the activation dtype, fp32
accumulation), which runs wherever the bf16 experts run. On CPU, and on CUDA without
triton, the torch path (`headmoe.moe.fp8_experts.experts_fp8`) widens in torch; the
Triton kernels widen with the hardware's conversion on sm_89+ and with integer bit
operations below (`headmoe.moe.triton_fp8.native_fp8`, the one place the capability is
read; both widenings exact, so the same bits). So no request is refused for its device's
FP8 support; W8A8 (FP8 tensor cores, sm_89+) would add the first such refusal here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from headmoe.config import GIB, is_number
from headmoe.deployment import stream_of
from headmoe.errors import Refusal
from headmoe.pipeline import latents
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.recipe import (
    REFINER_RESOLUTIONS,
    RELEASED_SECONDS,
    RESOLUTIONS,
    Recipe,
)
from headmoe.pipeline.request import (
    MAX_SECONDS,
    MAX_SIDE,
    REQUEST_FIELDS,
    GenerateRequest,
    check_field,
    show,
)
from headmoe.pipeline.seeding import SEED_LIMIT
from headmoe.planner.memory import MemoryEstimate, estimate_memory
from headmoe.planner.request import RequestShape
from headmoe.release import audio_vae

if TYPE_CHECKING:  # imported where they are used (the refiner and time rules)
    from headmoe.pipeline.refine import RefinerStage
    from headmoe.planner.time import TimeEstimate

#: the refiner stage's fields (``resolution="1080p"`` sets its size)
REFINER_FIELDS: tuple[str, ...] = ("refiner_height", "refiner_width", "refiner_steps")
#: the fields a request may give: a `GenerateRequest`'s, the three that set its size and
#: the refiner's
INPUT_FIELDS: tuple[str, ...] = (*REQUEST_FIELDS, "resolution", "seconds", "size",
                                 *REFINER_FIELDS)
#: where a resolved field's value came from
GIVEN_BY_FLAG, GIVEN_BY_REQUEST, MODEL_DEFAULT = "flag", "request", "model default"
DEPLOYMENT = "server"
@dataclass(frozen=True)
class Admitted:
    """A checked request: the resolved `request`, where each field came from (`sources`),
    headmoe's notes on it (e.g. a clip length the release does not make), the token counts
    (`shape`) and the memory estimate."""

    request: GenerateRequest
    sources: dict[str, str]
    notes: list[str]
    shape: RequestShape
    estimate: MemoryEstimate
    recipe: str
    given: dict[str, object]
    refiner: RefinerStage | None = None
    """The `headmoe.pipeline.refine.RefinerStage` (1080p), or None."""
    time: TimeEstimate | None = None
    """The `headmoe.planner.time.TimeEstimate` of the request on the deployment."""

    def describe(self) -> dict[str, object]:
        """What the sidecar records (``admission``)."""
        return {"recipe": self.recipe, "sources": self.sources, "notes": self.notes,
                "time_estimate_s": None if self.time is None else round(self.time.seconds, 1),
                "time_estimate_source": None if self.time is None else self.time.source,
                "step_key": None if self.time is None else self.time.key,
                "given": {k: v for k, v in self.given.items()
                          if k not in ("prompt", "negative_prompt")},
                "tokens": self.shape.to_dict(), "estimate_bytes": self.estimate.total,
                "refiner": None if self.refiner is None else self.refiner.to_dict()}


# ---------------------------------------------------------------------- single fields
def _seconds(value: object) -> float:
    """``seconds``: a number or a numeric string ("4", as OpenAI-style clients send it)."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if not is_number(number) or not math.isfinite(number) or not 0 < number <= MAX_SECONDS:
        shown = f"{number:g}" if is_number(number) else show(value)  # "4" and 4 alike
        raise Refusal("seconds", value, f"seconds={shown} must be a number in "
                      f"(0, {MAX_SECONDS:g}]")
    return float(number)


def _size(value: object) -> tuple[int, int]:
    """``size`` "WxH" (OpenAI / vLLM-Omni) -> (height, width)."""
    m = re.fullmatch(r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*", value) if isinstance(value, str) else None
    if m is None or not all(1 <= int(v) <= MAX_SIDE for v in m.groups()):
        raise Refusal("size", value, f"size={show(value)} must be \"WIDTHxHEIGHT\" with each "
                      f"side in [1, {MAX_SIDE}], e.g. \"896x512\"")
    height, width = int(m.group(2)), int(m.group(1))
    for side in (("width", width), ("height", height)):
        try:
            latents.check_side(*side)
        except ValueError as e:
            raise Refusal("size", value, f"size={show(value)}: {e}") from None
    return height, width


def _resolution(value: object) -> tuple[int, int]:
    """(height, width) of the preview stage: the preset's, or for a refiner preset (1080p)
    its preview's (540p: REFINER.md section 1)."""
    if not isinstance(value, str) or value not in RESOLUTIONS:
        raise Refusal("resolution", value, f"resolution={show(value)} must be one of "
                      f"{', '.join(RESOLUTIONS)}")
    return RESOLUTIONS[REFINER_RESOLUTIONS.get(value, value)]


def _refiner_field(name: str) -> Callable[[object], int]:
    def parse(value: object) -> int:
        from headmoe.pipeline.refine import RefinerStage

        try:
            RefinerStage(**{name.removeprefix("refiner_"): value})  # type: ignore[arg-type]
        except ValueError as e:
            raise Refusal(name, value, str(e)) from None
        return cast(int, value)  # RefinerStage took it: an int
    return parse


def refiner_stage(given: Mapping[str, object]) -> RefinerStage | None:
    """The `RefinerStage` of checked ``given`` fields: a refiner preset's size (1080p:
    1088 x 1920) or the refiner fields, the released steps by default; None without
    either."""
    from headmoe.pipeline.refine import RefinerStage

    preset = given.get("resolution") in REFINER_RESOLUTIONS
    if not preset and not any(k in given for k in REFINER_FIELDS):
        return None
    d = RefinerStage()
    height, width = RESOLUTIONS[cast(str, given["resolution"])] if preset else (d.height,
                                                                                 d.width)
    # the refiner fields were checked by `check_given` (`_refiner_field`): ints
    return RefinerStage(cast(int, given.get("refiner_height", height)),
                        cast(int, given.get("refiner_width", width)),
                        cast(int, given.get("refiner_steps", d.steps)))


def check_given(given: Mapping[str, object]) -> dict[str, object]:
    """Steps 1-2 of the module docstring (no deployment needed): each given field's rule,
    then the contradictions. Returns the given fields with ``resolution`` / ``size`` /
    ``seconds`` parsed (tuples, float). Raises `Refusal`."""
    for name, value in given.items():
        if name not in INPUT_FIELDS:
            raise Refusal(name, value, f"unknown field {name}={show(value)}")
    out = dict(given)
    for name in INPUT_FIELDS:  # a fixed order: the first bad field is the one reported
        if name not in given:
            continue
        parse = {"seconds": _seconds, "size": _size, "resolution": _resolution,
                 **{f: _refiner_field(f) for f in REFINER_FIELDS}}.get(name)
        out[name] = parse(given[name]) if parse else check_field(name, given[name])
        if name in GEOMETRY:
            _geometry(name, out[name], GEOMETRY[name])
    _check_sizes(given, out)
    return out


#: the decoders' rule of each size field (the defaults of every recipe pass them)
GEOMETRY: dict[str, Callable[[int], object]] = {
    "height": lambda v: latents.check_side("height", v),
    "width": lambda v: latents.check_side("width", v),
    "num_frames": latents.check_frames,
}


def _geometry(name: str, value: object, rule: Callable[[int], object]) -> None:
    try:
        rule(cast(int, value))  # `check_field` took it: an int
    except ValueError as e:
        raise Refusal(name, value, str(e)) from None


def _check_sizes(given: Mapping[str, object], parsed: Mapping[str, object]) -> None:
    """``resolution``, ``size`` and ``height`` / ``width`` must agree where several are
    given; so must ``seconds`` and ``num_frames`` (checked in `_frames`)."""
    sources = [(n, cast(tuple[int, int], parsed[n])) for n in ("resolution", "size")
               if n in parsed]  # parsed by `_resolution` / `_size`
    for i, (a, (h, w)) in enumerate(sources):
        for b, (h2, w2) in sources[i + 1:]:
            if (h, w) != (h2, w2):
                raise Refusal(f"{a},{b}", given[b], f"{a}={given[a]!r} ({w}x{h}) contradicts "
                              f"{b}={given[b]!r} ({w2}x{h2}); give one of them")
        for side, want in (("height", h), ("width", w)):
            if side in parsed and parsed[side] != want:
                raise Refusal(f"{a},{side}", given[side], f"{a}={given[a]!r} means {side}="
                              f"{want}, which contradicts {side}={parsed[side]}; give one "
                              "of them")


# ---------------------------------------------------------------------- resolution
def frames_for_seconds(seconds: float, fps: float) -> int:
    """Output frames of a ``seconds``-long clip at ``fps``: the largest ``4k+1`` not above
    ``seconds * fps`` (at least 1); 10 s at 12.5 fps = 125 frames, the released clip."""
    stride = latents.TEMPORAL_STRIDE
    return stride * max(0, math.floor((seconds * fps - 1) / stride + 1e-9)) + 1


def _frames(given: Mapping[str, object], parsed: Mapping[str, object], fps: float,
            recipe: Recipe) -> tuple[int | None, list[str]]:
    """(num_frames from ``seconds`` or None, notes)."""
    if "seconds" not in parsed:
        return None, []
    seconds = cast(float, parsed["seconds"])  # parsed by `_seconds`
    frames = frames_for_seconds(seconds, fps)
    if "num_frames" in parsed and parsed["num_frames"] != frames:
        raise Refusal("seconds,num_frames", given["num_frames"],
                      f"seconds={seconds:g} at fps={fps:g} means num_frames={frames}, "
                      f"which contradicts num_frames={parsed['num_frames']}; give one of them")
    notes = []
    made = f"{frames} frames at {fps:g} fps = {frames / fps:.3g} s"
    if not math.isclose(frames / fps, seconds, rel_tol=1e-9):
        made += (f" (rounded down from {seconds:g} s: num_frames is 4k+1, the largest not "
                 "above seconds x fps)")
    if seconds != RELEASED_SECONDS:
        notes.append(f"seconds={seconds:g} is headmoe's extension (the release makes "
                     f"{RELEASED_SECONDS:g} s clips): {made}")
    return frames, notes


def resolve(given: Mapping[str, object], recipe: Recipe, device: str,
            origin: str = GIVEN_BY_FLAG) -> tuple[dict[str, object], dict[str, str], list[str]]:
    """(values of every `GenerateRequest` field but the prompt when absent, their sources,
    notes): the given fields (checked by `check_given`), the rest from ``recipe``."""
    parsed = check_given(given)
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for name in REQUEST_FIELDS:
        if name in parsed:
            values[name], sources[name] = parsed[name], origin
        elif name != "prompt":
            values[name], sources[name] = recipe.default(name, device), MODEL_DEFAULT
    for key in ("size", "resolution"):  # a preset or size gives height and width
        if key in parsed:
            (values["height"], values["width"]) = cast(tuple[int, int], parsed[key])
            sources["height"] = sources["width"] = f"{origin} ({key})"
    frames, notes = _frames(given, parsed, cast(float, values["fps"]), recipe)
    if frames is not None:
        values["num_frames"], sources["num_frames"] = frames, f"{origin} (seconds)"
    return values, sources, notes


def check_geometry(num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The video latent grid of the decoders (`latents.latent_shape`), as a
    `Refusal` naming the field that does not fit."""
    try:
        return latents.latent_shape(num_frames, height, width)
    except ValueError as e:
        name = str(e).split()[0]
        raise Refusal(name, {"num_frames": num_frames, "height": height,
                             "width": width}.get(name), str(e)) from None


def check_seed(seed: int, dp_size: int) -> int:
    """Every data-parallel group's seed (``seed + k``, k < ``dp_size``) below 2**63."""
    if seed + dp_size - 1 >= SEED_LIMIT:
        raise Refusal("seed", seed, f"seed={seed} is above {SEED_LIMIT - dp_size}: "
                      f"data-parallel group k uses seed + k and all {dp_size} must be below "
                      "2**63")
    return seed


def byte_tokens(text: str) -> int:
    """Tokens the stand-in byte encoder keeps of ``text`` (BOS + UTF-8 bytes, at most its
    limit)."""
    from headmoe.release.standins import ByteTextEncoder

    return len(ByteTextEncoder(1).tokenize(text))


def request_shape(req: GenerateRequest, count_tokens: Callable[[str], int] | None,
                  image: bool = False) -> RequestShape:
    """The per-branch token counts of ``req`` (text counted by ``count_tokens``; with an
    ``image``, the most rows any reference image adds at this size)."""
    from headmoe.models.magi2.packing import image_rows
    from headmoe.pipeline.image import max_latent_size

    count = count_tokens or byte_tokens
    latent = check_geometry(req.num_frames, req.height, req.width)
    audio = audio_vae.audio_latent_length(req.duration_s)
    rows = image_rows(*max_latent_size(req.height, req.width)) if image else 0
    return RequestShape(latent, audio, (count(req.prompt), count(req.negative_prompt)), rows)


def admit(given: Mapping[str, object], dep: Deployment, origin: str = GIVEN_BY_FLAG,
          image: bool = False) -> Admitted:
    """The checked, resolved request of ``given`` (field -> value; fields left out take the
    model's recipe) on ``dep``, or `Refusal` (module docstring: what is checked, in order).
    ``dep.dtype``: the dtype the deployment sets for every request (a server's); ``image``:
    an image-to-video request (its image rows count in the memory estimate)."""
    if "prompt" not in given:
        raise Refusal("prompt", None, "prompt is required")
    values, sources, notes = resolve(given, dep.recipe, dep.device, origin)
    if dep.dtype is not None:
        values["dtype"], sources["dtype"] = check_field("dtype", dep.dtype), DEPLOYMENT
    req = GenerateRequest(**values)  # type: ignore[arg-type]  # it checks every field itself
    shape = request_shape(req, dep.count_tokens, image)
    samples = req.audio_samples(audio_vae.OUTPUT_SAMPLE_RATE)
    check_seed(req.seed, dep.parallel.data_parallel_size)
    if req.noise_device == "cuda" and dep.device != "cuda":
        raise Refusal("noise_device", req.noise_device, "noise_device='cuda' draws the noise "
                      "on the GPU, but no CUDA device is available here; use "
                      "noise_device='cpu'")
    est = estimate_memory(dep.model_config, shape, dep.parallel, req.torch_dtype,
                          (req.num_frames, req.height, req.width), samples, stream=stream_of(dep),
                          experts=dep.expert_format)
    refiner = refiner_stage(given)
    if refiner is None:
        est = _with_resident_refiner(est, dep, req)
    limit = dep.budget.limit
    if limit is not None and est.total > limit:
        raise Refusal("height,width,num_frames", req.height,
                      f"{dep.describe or 'the model'}: height={req.height}, width={req.width}, "
                      f"num_frames={req.num_frames} need an estimated {est.describe()}, more "
                      f"than the {limit / GIB:.2f} GiB limit ({dep.budget.source}); use a "
                      "smaller request, more ranks, or a larger --max-memory-gib")
    if refiner is not None:
        _check_refiner(given, dep, refiner, req, shape, est)
    time = check_time(dep, req, shape, refiner)
    return Admitted(req, sources, notes, shape, est, dep.recipe.name, dict(given), refiner,
                    time)


def check_time(dep: Deployment, req: GenerateRequest, shape: RequestShape,
               refiner: RefinerStage | None) -> TimeEstimate:
    """The request's `TimeEstimate` (`headmoe.planner.time`), refused when over
    ``dep.max_time_s`` naming the estimate and the fields that set it."""
    from headmoe.planner.time import estimate_time, measured_step, step_key

    extra, extra_steps = 0.0, 0
    if refiner is not None and dep.refiner_config is not None:
        from headmoe.planner.refiner import refiner_work

        thw = refiner.latent_thw(shape.video_latent[0])
        work = refiner_work(dep.refiner_config, thw, max(shape.text_tokens))
        extra, extra_steps = 2 * refiner.steps * work.flop, refiner.steps
    tokens = (shape.branch_tokens(0), shape.branch_tokens(1))
    key = step_key(dep.model_config, dep.parallel, dep.device, dep.threads, req.dtype, tokens,
                   dep.offload_layers)
    est = estimate_time(dep.model_config, tokens, dep.parallel, req.num_inference_steps,
                        dep.device, dep.threads, extra, extra_steps,
                        measured_step(dep.step_cache, key), key)
    if dep.max_time_s is not None and est.seconds > dep.max_time_s:
        raise Refusal("num_inference_steps,height,width,num_frames", req.num_inference_steps,
                      f"{dep.describe or 'the model'}: num_inference_steps="
                      f"{req.num_inference_steps}, height={req.height}, width={req.width}, "
                      f"num_frames={req.num_frames} take an estimated "
                      f"{est.describe()[1:]} on {dep.parallel.world_size} "
                      f"{dep.device} rank(s), over max_time={dep.max_time_s:g} s; use fewer "
                      "steps, a smaller size, fewer frames, more ranks or a larger max_time "
                      "(docs/guide.md, 'On a CPU')")
    return est


def _with_resident_refiner(est: MemoryEstimate, dep: Deployment,
                           req: GenerateRequest) -> MemoryEstimate:
    """``est`` plus the refiner's weights when ``dep`` keeps them on the device for every
    request (`Deployment.resident_refiner`, not offloaded)."""
    if not dep.resident_refiner or dep.refiner_config is None or dep.offload:
        return est
    from headmoe.models.refiner import refiner_weight_bytes

    extra = refiner_weight_bytes(dep.refiner_config, req.torch_dtype)
    return MemoryEstimate(est.weights + extra, est.activations, est.workspace, est.decode)


def _check_refiner(given: Mapping[str, object], dep: Deployment, stage: RefinerStage,
                   req: GenerateRequest, shape: RequestShape, preview: MemoryEstimate) -> None:
    """The refiner stage on ``dep``: a refiner there, its heads split by the layout, and
    the busiest phase (`headmoe.planner.refiner.stage_estimate`) within the budget."""
    from headmoe.models.refiner import validate_parallel
    from headmoe.planner.refiner import stage_estimate

    field = "resolution" if "resolution" in given else next(
        k for k in REFINER_FIELDS if k in given)
    if dep.refiner_config is None:
        why = (f": its refiner/ failed its checks: {dep.refiner_problem}" if dep.refiner_problem
               else " (headmoe generate with a release folder that has refiner/)")
        raise Refusal(field, given[field], f"{field}={given[field]!r} needs the refiner "
                      f"stage, which {dep.describe or 'this deployment'} does not run{why}")
    validate_parallel(dep.refiner_config, dep.parallel)
    thw = stage.latent_thw(shape.video_latent[0])
    est = stage_estimate(dep.refiner_config, stage, thw, max(shape.text_tokens), dep.parallel,
                         req.torch_dtype, preview, dep.offload)
    limit = dep.budget.limit
    if limit is not None and est.total > limit:
        raise Refusal(field, given[field],
                      f"{dep.describe or 'the model'}: the refiner stage at "
                      f"{stage.width}x{stage.height} (latent {thw[0]}x{thw[1]}x{thw[2]}) with "
                      f"the preview needs an estimated {est.describe()}, more than the "
                      f"{limit / GIB:.2f} GiB limit ({dep.budget.source}); use a smaller "
                      "refiner size, more ranks, --offload or a larger --max-memory-gib")
