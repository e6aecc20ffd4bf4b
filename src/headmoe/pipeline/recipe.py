"""The recipes a model runs by default, and the request presets (MAGI2.md section 6.8-6.9).

A MAGI-2 Preview release runs the released recipe (`RELEASED`): 540p (896 x 512), 10 s
(125 frames at 12.5 fps, 441,000 audio samples at 44.1 kHz), 100 steps, shift 7.0,
guidance 5.0 (video) / 7.0 (audio), the released negative prompt, seed 42, bf16 on a GPU
(fp32 on a CPU, where bf16 matmuls are slow). The embedded tiny release keeps fast CPU
defaults (`TINY`: `GenerateRequest`'s own defaults). `recipe_for` picks one by the model
configuration; `headmoe.pipeline.admission` fills every field a request leaves out from it.

Sources: SandAI's MAGI-2 reference inference code and vLLM-Omni's port of it (the preset
sizes, the 10 s clip, the defaults and the negative prompt text, byte-exact: the golden
copy ``golden/magi2_pipeline/negative_prompt.txt``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from headmoe.pipeline.request import GenerateRequest

#: resolution presets: name -> (height, width) of the transformer's video
RESOLUTIONS: dict[str, tuple[int, int]] = {"272p": (256, 448), "540p": (512, 896),
                                           "1080p": (1088, 1920)}
#: presets that need the refiner (REFINER.md): the 540p preview, then 1920 x 1088
REFINER_RESOLUTIONS = frozenset({"1080p"})
#: the released clip: 10 s at 12.5 fps
RELEASED_SECONDS, RELEASED_FPS = 10.0, 12.5

# The released default negative prompt (1,721 characters).
RELEASED_NEGATIVE_PROMPT = (
    'Bright tones, overexposed, static, blurred details, subtitles, style, works, '
    'paintings, images, static, overall gray, worst quality, low quality, JPEG '
    'compression residue, ugly, incomplete, extra fingers, poorly drawn hands, poorly '
    'drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, '
    'messy background, three legs, many people in the background, walking backwards, low '
    'quality, worst quality, poor quality, noise, background noise, hiss, hum, buzz, '
    'crackle, static, compression artifacts, MP3 artifacts, digital clipping, '
    'distortion, muffled, muddy, unclear, echo, reverb, room echo, over-reverberated, '
    'hollow sound, distant, washed out, harsh, shrill, piercing, grating, tinny, thin '
    'sound, boomy, bass-heavy, flat EQ, over-compressed, abrupt cut, jarring transition, '
    'sudden silence, looping artifact, music, instrumental, sirens, alarms, crowd noise, '
    'unrelated sound effects, chaotic, disorganized, messy, cheap sound, emotionless, '
    'flat delivery, deadpan, lifeless, apathetic, robotic, mechanical, monotone, flat '
    'intonation, undynamic, boring, reading from a script, AI voice, synthetic, '
    'text-to-speech, TTS, insincere, fake emotion, exaggerated, overly dramatic, '
    'melodramatic, cheesy, cringey, hesitant, unconfident, tired, weak voice, '
    'stuttering, stammering, mumbling, slurred speech, mispronounced, bad articulation, '
    'lisp, vocal fry, creaky voice, mouth clicks, lip smacks, wet mouth sounds, heavy '
    'breathing, audible inhales, plosives, p-pops, coughing, clearing throat, sneezing, '
    'speaking too fast, rushed, speaking too slow, dragged out, unnatural pauses, '
    'awkward silence, choppy, disconnected, multiple speakers, two voices, background '
    'talking, out of tune, off-key, autotune artifacts'
)


@dataclass(frozen=True)
class Recipe:
    """A model's defaults: ``values`` for every `GenerateRequest` field but the prompt (the
    CPU dtype), ``cuda_dtype`` the dtype on a GPU, ``resolution`` / ``seconds`` the presets
    the size comes from (None: explicit height, width, num_frames)."""

    name: str
    values: dict[str, Any]
    cuda_dtype: str
    resolution: str | None = None
    seconds: float | None = None

    def default(self, field: str, device: str) -> Any:
        """The default of ``field`` on ``device`` ("cpu" or "cuda")."""
        if field == "dtype" and device == "cuda":
            return self.cuda_dtype
        return self.values[field]


_TINY = {f.name: f.default for f in fields(GenerateRequest) if f.name != "prompt"}
TINY = Recipe("tiny", _TINY, cuda_dtype=_TINY["dtype"])
RELEASED = Recipe(
    "magi2-preview",
    {**_TINY, "negative_prompt": RELEASED_NEGATIVE_PROMPT, "height": RESOLUTIONS["540p"][0],
     "width": RESOLUTIONS["540p"][1], "num_frames": 125, "fps": RELEASED_FPS,
     "num_inference_steps": 100, "seed": 42, "guidance_scale": 5.0,
     "audio_guidance_scale": 7.0, "shift": 7.0, "sampler": "unipc", "dtype": "fp32"},
    cuda_dtype="bf16", resolution="540p", seconds=RELEASED_SECONDS,
)


def recipe_for(model_config: Any) -> Recipe:
    """`TINY` for a model with the tiny preset's shape (the embedded release, whatever its
    name), `RELEASED` for every other (MAGI-2 Preview and its variants)."""
    from headmoe.models.magi2 import get_config

    tiny = {**get_config("tiny").to_dict(), "name": None}
    return TINY if {**model_config.to_dict(), "name": None} == tiny else RELEASED
