"""One text-to-video+audio request (pure data, validated on construction), the limits of
each field and the dtype table.

`check_field` is the one home of the rules of a single field (type, range, limits); the
rules that join fields or need the deployment (presets, ``seconds``, frame geometry from
the decoder in use, the seed range of a data-parallel job, token counts, the memory
estimate) are `headmoe.pipeline.admission`'s. Every entry point (``generate``, ``serve``,
``compare``, ``plan``) goes through both. A refused value raises `Refusal` naming the field
and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from headmoe.config import DTYPES, is_int, is_number
from headmoe.errors import Refusal
from headmoe.pipeline.sampler import SAMPLERS
from headmoe.pipeline.seeding import SEED_LIMIT

#: where the initial noise is drawn: "cpu" (every layout and device gives the same bytes)
#: or "cuda" (the reference's CUDA generator: values depend on the GPU model)
NOISE_DEVICES: tuple[str, ...] = ("cpu", "cuda")

#: headmoe's default negative prompt of the embedded tiny release (our own wording; a
#: MAGI-2 Preview release uses the released text, `headmoe.pipeline.recipe`)
DEFAULT_NEGATIVE_PROMPT = (
    "blurry, low quality, distorted, deformed, watermark, text, flicker, frozen frame, "
    "noisy audio"
)

# ---------------------------------------------------------------------- limits
#: the longest prompt / negative prompt (characters); --prompt-file reads at most 4x bytes
MAX_PROMPT_CHARS = 100_000
#: denoising steps (the scheduler has 1000 training timesteps: more would repeat them)
MAX_INFERENCE_STEPS = 1000
#: pixels of height and width (the refiner's 1920 x 1088 fits)
MAX_SIDE = 4096
#: output frames (4k+1; 80 s at 12.5 fps)
MAX_NUM_FRAMES = 1001
#: frame rate (frames per second)
MIN_FPS, MAX_FPS = 1.0, 120.0
#: clip length of ``seconds``
MAX_SECONDS = 80.0
#: classifier-free guidance scales (video and audio) and the flow-matching shift
MAX_GUIDANCE, MAX_SHIFT = 100.0, 100.0


def show(value: object) -> str:
    """``repr(value)`` cut to at most 60 characters (a 200-digit number stays readable)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:24]}...{text[-8:]} ({len(text)} characters)"


def _int_in(lo: int, hi: int, what: str = "") -> Callable[[str, object], int]:
    def check(name: str, value: object) -> int:
        if not is_int(value) or not lo <= value <= hi:
            raise Refusal(name, value, f"{name}={show(value)} must be an integer in "
                          f"[{lo}, {what or hi}]")
        return value
    return check


def _number_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[str, object], float]:
    def check(name: str, value: object) -> float:
        if not (is_number(value) and math.isfinite(value) and value <= hi
                and (value > lo if lo_open else value >= lo)):
            low = f"({lo:g}" if lo_open else f"[{lo:g}"
            raise Refusal(name, value, f"{name}={show(value)} must be a number in {low}, {hi:g}]")
        return value
    return check


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise Refusal(name, value, f"{name}={show(value)} must be text")
    if len(value) > MAX_PROMPT_CHARS:
        raise Refusal(name, value, f"{name} has {len(value):,} characters, more than the "
                      f"limit of {MAX_PROMPT_CHARS:,}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Refusal(name, value, f"{name} is not valid UTF-8 text (character {e.start}: "
                      f"{value[e.start]!r})") from None
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[str, object], str]:
    def check(name: str, value: object) -> str:
        if value not in choices:
            raise Refusal(name, value, f"{name}={show(value)} must be one of "
                          f"{', '.join(choices)}")
        return value
    return check


#: the rule of each `GenerateRequest` field
FIELD_RULES: dict[str, Callable[[str, object], object]] = {
    "prompt": _text,
    "negative_prompt": _text,
    "height": _int_in(1, MAX_SIDE),
    "width": _int_in(1, MAX_SIDE),
    "num_frames": _int_in(1, MAX_NUM_FRAMES),
    "fps": _number_in(MIN_FPS, MAX_FPS),
    "num_inference_steps": _int_in(1, MAX_INFERENCE_STEPS),
    "seed": _int_in(0, SEED_LIMIT - 1, "2**63 - 1"),
    "guidance_scale": _number_in(0.0, MAX_GUIDANCE),
    "audio_guidance_scale": _number_in(0.0, MAX_GUIDANCE),
    "shift": _number_in(0.0, MAX_SHIFT, lo_open=True),
    "sampler": _choice(SAMPLERS),
    "dtype": _choice(tuple(DTYPES)),
    "noise_device": _choice(NOISE_DEVICES),
}


def check_field(name: str, value: object) -> object:
    """``value`` if it passes field ``name``'s rule (`FIELD_RULES`), else `Refusal`."""
    return FIELD_RULES[name](name, value)


@dataclass(frozen=True)
class GenerateRequest:
    """What to generate, resolved (`headmoe.pipeline.admission.admit` fills what a caller
    leaves out from the model's recipe). The defaults here are the embedded tiny release's
    recipe, sized for a CPU: 13 frames of 64 x 96 at 12.5 fps (1.04 s; 4 x 4 x 6 video
    latents and 26 audio latents), 8 steps."""

    prompt: str
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    height: int = 64
    width: int = 96
    num_frames: int = 13
    fps: float = 12.5
    num_inference_steps: int = 8
    seed: int = 0
    guidance_scale: float = 5.0
    """Video guidance scale s in v = v_u + s (v_c - v_u)."""
    audio_guidance_scale: float = 7.0
    shift: float = 7.0
    """Flow-matching time shift."""
    sampler: str = "unipc"
    dtype: str = "fp32"
    """Dtype of the transformer's linears and experts ("fp32" or "bf16"); latents, sampler
    and decoders are always fp32."""
    noise_device: str = "cpu"
    """Generator of the initial noise (`NOISE_DEVICES`)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))

    @property
    def duration_s(self) -> float:
        """num_frames / fps."""
        return self.num_frames / self.fps

    def audio_samples(self, sample_rate: int) -> int:
        """Audio samples of the clip at `sample_rate` Hz: `round(duration_s * sample_rate)`
        (at least 367 at 44.1 kHz: one frame at the highest `MAX_FPS`)."""
        return round(self.duration_s * sample_rate)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


#: a resolved request's fields, in order
REQUEST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GenerateRequest))
