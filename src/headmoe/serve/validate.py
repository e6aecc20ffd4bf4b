"""The HTTP request body of ``POST /v1/videos`` and its validation.

`parse_body` checks the JSON types only (strict: no string-to-number coercion but for
``seconds``, unknown fields rejected); `to_generate_request` then hands the fields the body
gives to `headmoe.admission.admit` with the server's deployment, the same admission
``headmoe generate`` runs, so both refuse the same requests with the same message. A
refusal raises `RequestError` naming the field (``param``) and the value, before the job
is queued, so bad input never reaches a rank.

Field names follow the OpenAI / vLLM-Omni / SGLang video APIs: ``prompt``,
``negative_prompt``, ``seed``, ``num_inference_steps``, ``guidance_scale``,
``audio_guidance_scale``, ``height``, ``width``, ``size`` ("WxH"), ``resolution`` (a
preset), ``num_frames`` or ``seconds`` (a number or a numeric string), ``fps``; headmoe
adds ``shift``, ``sampler``, ``noise_device`` and the refiner's ``refiner_height``,
``refiner_width``, ``refiner_steps`` (as generate's flags; ``resolution: "1080p"`` sets
them); ``model`` may name the served model. Fields left out take
the served model's recipe (`headmoe.pipeline.recipe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, ValidationError

from headmoe.admission import GIVEN_BY_REQUEST, Admitted, admit
from headmoe.errors import Refusal
from headmoe.pipeline.request import show
from headmoe.serve.spec import ServeSpec
from headmoe.serve.state import Job


class VideoCreate(BaseModel):
    """The JSON body of ``POST /v1/videos`` (and ``/v1/videos/sync``); types only (strict:
    no string-to-number coercion), the values are admission's (`to_generate_request`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    audio_guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    size: str | None = None
    resolution: str | None = None
    num_frames: int | None = None
    seconds: float | str | None = None
    """Clip length; OpenAI-style clients send it as a string ("4")."""
    fps: float | None = None
    shift: float | None = None
    sampler: str | None = None
    noise_device: str | None = None
    refiner_height: int | None = None
    refiner_width: int | None = None
    refiner_steps: int | None = None
    model: str | None = None


@dataclass
class RequestError(ValueError):
    """A rejected request: ``param`` the field (or fields), ``message`` names it and its
    value; ``status`` the HTTP status (400 malformed body, 422 a bad field)."""

    message: str
    param: str | None = None
    status: int = 422
    headers: dict[str, str] = field(default_factory=dict)
    """Response headers (``Retry-After`` of a 503)."""

    def __str__(self) -> str:
        return self.message


def parse_body(raw: bytes) -> VideoCreate:
    """Parse and type-check a JSON body; raises `RequestError` naming the first bad field."""
    try:
        return VideoCreate.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int))
        loc = loc.split(".")[0] if loc else loc  # a union's member type is not a field
        kind, value = err["type"], err.get("input")
        if kind == "json_invalid" or not loc:
            raise RequestError(f"the body must be a JSON object: {err['msg']}", None, 400) from None
        if kind == "missing":
            raise RequestError(f"{loc} is required", loc) from None
        if kind == "extra_forbidden":
            raise RequestError(f"unknown field {loc}={show(value)}", loc) from None
        raise RequestError(f"{loc}={show(value)}: {err['msg']}", loc) from None


def admit_body(body: VideoCreate, spec: ServeSpec, image: bool = False) -> Admitted:
    """The admitted request of a parsed body under ``spec`` (the server's deployment and
    dtype; ``image``: it carries an I2V image); raises `RequestError` naming the field and
    its value."""
    names = spec.model_names
    if body.model is not None and body.model not in names:
        raise RequestError(f"model={show(body.model)} is not served here (this server serves "
                           f"{' or '.join(map(repr, names)) or 'one unnamed model'}; or leave "
                           "model out)", "model")
    given = body.model_dump(exclude={"model"}, exclude_none=True)
    try:
        return admit(given, spec.deployment, GIVEN_BY_REQUEST, image=image)
    except Refusal as exc:
        raise RequestError(exc.message, exc.field) from None


def to_generate_request(body: VideoCreate, spec: ServeSpec):
    """The `GenerateRequest` of a parsed body under ``spec`` (`admit_body`)."""
    return admit_body(body, spec).request


def readmit(job: Job, spec: ServeSpec) -> Job:
    """A queued ``job`` of a restarted server admitted again on ``spec`` (it may serve
    another model or budget): the fields its client gave (its admission's ``given``, and
    the prompts, which ``given`` leaves out) through `admit_body`'s `admit`; the fields it
    left out take this server's recipe. Raises `RequestError` (a `ValueError`) with the
    refusal, also when its image was preprocessed for another long side than the request
    now has."""
    given = dict(job.admission.get("given", {}))
    given["prompt"] = job.request.prompt
    if job.admission.get("sources", {}).get("negative_prompt") == GIVEN_BY_REQUEST:
        given["negative_prompt"] = job.request.negative_prompt
    try:
        admitted = admit(given, spec.deployment, GIVEN_BY_REQUEST, image=job.image is not None)
    except Refusal as exc:
        raise RequestError(exc.message, exc.field) from None
    req = admitted.request
    if job.image is not None and job.image.long_side != max(req.height, req.width):
        raise RequestError(f"image: preprocessed for a long side of {job.image.long_side}, "
                           f"but the request is now {req.width}x{req.height} on this server",
                           "image")
    return replace(job, request=req, admission=admitted.describe(), refiner=admitted.refiner)
