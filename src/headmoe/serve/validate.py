"""The HTTP request body of ``POST /v1/videos`` and its complete validation.

A body becomes a `GenerateRequest` only after every check ``headmoe generate`` makes on a
request (field types and ranges, the decoder's size rules, an audio track of at least one
sample) and the memory estimate below; anything else raises `RequestError` naming the field
and the value, before the job is queued, so bad input never reaches a rank.

Field names follow the vLLM-Omni / SGLang video APIs: ``prompt``, ``negative_prompt``,
``seed``, ``num_inference_steps``, ``guidance_scale``, ``audio_guidance_scale``, ``height``,
``width``, ``num_frames`` (or ``seconds``, converted with ``fps``: ``num_frames =
round(seconds * fps)``), ``fps``; headmoe adds ``shift`` and ``sampler``; ``model`` may name
the served model. Unknown fields are rejected, not ignored.

Memory estimate (per rank, busiest rank): the planner's weight bytes of the layout
(`headmoe.planner.weight_bytes`) plus activations, ``tokens_on_rank x hidden_size x 4 B x
(ACTIVATION_COPIES + mhc_streams)`` plus one attention segment's fp32 scores
``heads_per_rank x L_segment^2 x 4 B`` (as the math kernel materialises them): a
conservative bound, compared with the server's ``--memory-gib``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from headmoe.pipeline.encoders import ByteTextEncoder, TinyAudioDecoder, TinyVideoDecoder
from headmoe.pipeline.request import GenerateRequest
from headmoe.planner import (
    RequestShape,
    layout_topology,
    sequence_branches,
    sequence_counts,
    weight_bytes,
)
from headmoe.serve.spec import ServeSpec

_D = {f.name: f.default for f in fields(GenerateRequest)}
#: live [tokens, hidden] fp32 tensors per token assumed by the memory estimate
ACTIVATION_COPIES = 16
#: the largest seed torch's generator takes
MAX_SEED = 2**64 - 1
#: the longest prompt accepted (characters); the tiny text encoder reads 255 bytes of it
MAX_PROMPT_CHARS = 100_000
GIB = 1 << 30


class VideoCreate(BaseModel):
    """The JSON body of ``POST /v1/videos`` (and ``/v1/videos/sync``); types only (strict:
    no string-to-number coercion), the ranges are checked by `to_generate_request`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
    negative_prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] = _D["negative_prompt"]
    seed: int = _D["seed"]
    num_inference_steps: int = _D["num_inference_steps"]
    guidance_scale: float = _D["guidance_scale"]
    audio_guidance_scale: float = _D["audio_guidance_scale"]
    height: int = _D["height"]
    width: int = _D["width"]
    num_frames: int | None = None
    seconds: Annotated[float | None, Field(strict=False)] = None
    """Clip length; OpenAI-style clients send it as a string ("4")."""
    fps: float = _D["fps"]
    shift: float = _D["shift"]
    sampler: str = _D["sampler"]
    model: str | None = None


@dataclass
class RequestError(ValueError):
    """A rejected request: ``param`` the field (or fields), ``message`` names it and its
    value; ``status`` the HTTP status (400 malformed body, 422 a bad field)."""

    message: str
    param: str | None = None
    status: int = 422

    def __str__(self) -> str:
        return self.message


def parse_body(raw: bytes) -> VideoCreate:
    """Parse and type-check a JSON body; raises `RequestError` naming the first bad field."""
    try:
        return VideoCreate.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        kind, value = err["type"], err.get("input")
        if kind == "json_invalid" or not loc:
            raise RequestError(f"the body must be a JSON object: {err['msg']}", None, 400) from None
        if kind == "missing":
            raise RequestError(f"{loc} is required", loc) from None
        if kind == "extra_forbidden":
            raise RequestError(f"unknown field {loc}={_short(value)}", loc) from None
        raise RequestError(f"{loc}={_short(value)}: {err['msg']}", loc) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _num_frames(body: VideoCreate) -> int:
    if body.seconds is None:
        return _D["num_frames"] if body.num_frames is None else body.num_frames
    if body.num_frames is not None:
        raise RequestError(
            f"give num_frames or seconds, not both (num_frames={body.num_frames}, "
            f"seconds={body.seconds!r})",
            "seconds",
        )
    if not (math.isfinite(body.seconds) and body.seconds > 0):
        raise RequestError(f"seconds must be a positive number, got {body.seconds!r}", "seconds")
    if not (math.isfinite(body.fps) and body.fps > 0):
        raise RequestError(f"fps must be > 0, got {body.fps!r}", "fps")
    frames = round(body.seconds * body.fps)
    if frames < 1:
        raise RequestError(
            f"seconds={body.seconds!r} at fps={body.fps!r} is less than one frame", "seconds"
        )
    return frames


def to_generate_request(body: VideoCreate, spec: ServeSpec) -> GenerateRequest:
    """The `GenerateRequest` of a parsed body under ``spec``, after every check (see the
    module docstring). Raises `RequestError` naming the field and its value."""
    if body.model is not None and body.model not in (spec.model, spec.model_config.name):
        raise RequestError(
            f"model={body.model!r} is not served here (this server runs {spec.model!r})", "model"
        )
    for name in ("prompt", "negative_prompt"):
        try:
            getattr(body, name).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"{name} is not valid UTF-8 text: {exc.reason}", name) from None
    if body.seed > MAX_SEED:
        raise RequestError(f"seed must be <= {MAX_SEED}, got {body.seed!r}", "seed")
    values = body.model_dump(exclude={"model", "seconds"})
    values["num_frames"] = _num_frames(body)
    try:
        req = GenerateRequest(**values, dtype=spec.dtype)
        TinyVideoDecoder(1).latent_shape(req.num_frames, req.height, req.width)
        req.audio_samples(TinyAudioDecoder.sample_rate)
    except ValueError as exc:
        message = str(exc)
        field = message.split(maxsplit=1)[0].split("=")[0]
        raise RequestError(message, field if field in values else None) from None
    _check_memory(req, spec)
    return req


def estimate_rank_bytes(spec: ServeSpec, req: GenerateRequest) -> tuple[int, int]:
    """``(weight bytes, activation bytes)`` of the busiest rank for ``req`` under ``spec``'s
    layout (see the module docstring for the formula)."""
    cfg, parallel = spec.model_config, spec.parallel
    topo = layout_topology(cfg, parallel)
    e = topo.expert_parallel_size
    weights = max(weight_bytes(cfg, e, r, req.torch_dtype)[1] for r in range(e))
    tokens = ByteTextEncoder(1).tokenize
    shape = RequestShape.from_media(
        height=req.height,
        width=req.width,
        num_frames=req.num_frames,
        fps=req.fps,
        text_tokens=len(tokens(req.prompt)),
        uncond_text_tokens=len(tokens(req.negative_prompt)),
    )
    heads = cfg.num_attention_heads // parallel.ulysses_degree
    act = 0
    for cfg_rank in range(parallel.cfg_parallel_size):
        on_rank = max(sequence_counts(shape, parallel, cfg_rank))
        segment = max(shape.branch_tokens(b) for b in sequence_branches(parallel, cfg_rank))
        stream = on_rank * cfg.hidden_size * 4 * (ACTIVATION_COPIES + cfg.mhc_streams)
        act = max(act, stream + heads * segment * segment * 4)
    return weights, act


def _check_memory(req: GenerateRequest, spec: ServeSpec) -> None:
    if spec.memory_bytes is None:
        return
    weights, act = estimate_rank_bytes(spec, req)
    if weights + act > spec.memory_bytes:
        raise RequestError(
            f"height={req.height}, width={req.width}, num_frames={req.num_frames} need an "
            f"estimated {(weights + act) / GIB:.2f} GiB per rank ({weights / GIB:.2f} GiB "
            f"weights + {act / GIB:.2f} GiB activations), over the server's "
            f"{spec.memory_bytes / GIB:.2f} GiB",
            "height,width,num_frames",
        )
