"""The recipes a model runs by default, and the request presets (MAGI2.md section 6.8-6.9).

A MAGI-2 Preview release runs the released recipe (`RELEASED`): 540p (896 x 512), 10 s
(125 frames at 12.5 fps, 441,000 audio samples at 44.1 kHz), 100 steps, shift 7.0,
guidance 5.0 (video) / 7.0 (audio), the released negative prompt, seed 42, bf16 on a GPU
(fp32 on a CPU, where bf16 matmuls are slow). The embedded tiny release keeps fast CPU
defaults (`TINY`: `GenerateRequest`'s own defaults). `recipe_for` picks one by the model
configuration; `headmoe.pipeline.admission` fills every field a request leaves out from it.

Sources: SandAI's MAGI-2 reference inference code and vLLM-Omni's port of it (the preset
sizes and the 10 s clip, MAGI2.md section 6.8); the released values themselves live in
`headmoe.pipeline.released`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, cast, overload

from headmoe.models.magi2 import Magi2Config, get_config
from headmoe.pipeline.released import (
    RELEASED_AUDIO_GUIDANCE_SCALE,
    RELEASED_DTYPE,
    RELEASED_GUIDANCE_SCALE,
    RELEASED_NEGATIVE_PROMPT,
    RELEASED_NUM_INFERENCE_STEPS,
    RELEASED_SEED,
    RELEASED_SHIFT,
)
from headmoe.pipeline.request import GenerateRequest

#: resolution presets: name -> (height, width) of the transformer's video
RESOLUTIONS: dict[str, tuple[int, int]] = {"272p": (256, 448), "540p": (512, 896),
                                           "1080p": (1088, 1920)}
#: presets that need the refiner (REFINER.md) -> the preset of their preview stage: 1080p
#: is the 540p preview, then the refiner at 1920 x 1088
REFINER_RESOLUTIONS: dict[str, str] = {"1080p": "540p"}
#: the released clip: 10 s at 12.5 fps
RELEASED_SECONDS, RELEASED_FPS = 10.0, 12.5

@dataclass(frozen=True)
class Recipe:
    """A model's defaults: ``values`` for every `GenerateRequest` field but the prompt (the
    CPU dtype), ``cuda_dtype`` the dtype on a GPU, ``resolution`` / ``seconds`` the presets
    the size comes from (None: explicit height, width, num_frames)."""

    name: str
    values: dict[str, object]
    cuda_dtype: str
    resolution: str | None = None
    seconds: float | None = None

    @overload
    def default(self, field: Literal["dtype"], device: str) -> str: ...

    @overload
    def default(self, field: str, device: str) -> object: ...

    def default(self, field: str, device: str) -> object:
        """The default of ``field`` on ``device`` ("cpu" or "cuda")."""
        if field == "dtype" and device == "cuda":
            return self.cuda_dtype
        return self.values[field]


_TINY = {f.name: f.default for f in fields(GenerateRequest) if f.name != "prompt"}
TINY = Recipe("tiny", _TINY, cuda_dtype=cast(str, _TINY["dtype"]))  # GenerateRequest.dtype
RELEASED = Recipe(
    "magi2-preview",
    {**_TINY, "negative_prompt": RELEASED_NEGATIVE_PROMPT, "height": RESOLUTIONS["540p"][0],
     "width": RESOLUTIONS["540p"][1], "num_frames": 125, "fps": RELEASED_FPS,
     "num_inference_steps": RELEASED_NUM_INFERENCE_STEPS, "seed": RELEASED_SEED,
     "guidance_scale": RELEASED_GUIDANCE_SCALE,
     "audio_guidance_scale": RELEASED_AUDIO_GUIDANCE_SCALE, "shift": RELEASED_SHIFT,
     "sampler": "unipc", "dtype": "fp32"},
    cuda_dtype=RELEASED_DTYPE, resolution="540p", seconds=RELEASED_SECONDS,
)


def recipe_for(model_config: Magi2Config) -> Recipe:
    """`TINY` for a model with the tiny preset's shape (the embedded release, whatever its
    name), `RELEASED` for every other (MAGI-2 Preview and its variants)."""
    tiny = {**get_config("tiny").to_dict(), "name": None}
    return TINY if {**model_config.to_dict(), "name": None} == tiny else RELEASED
