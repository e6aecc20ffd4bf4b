"""The refiner stage of a 1080p request (REFINER.md sections 7-8): handoff from the
preview, re-noise, and the CFG sampler loop over the refiner.

Handoff: the preview's final video latent `[C, T, H, W]` is resized in fp32 with trilinear
interpolation (align_corners=True) to `(2T - 1, height // 16, width // 16)` and mixed once
with fresh Gaussian noise: `x = s x_up + (1 - s^2)^0.5 n`, s = entry 220 of the
zero-terminal-SNR DDPM table (0.8389104, a *signal* coefficient). The noise is the next
draw of the request's generator after the preview's noise.

Loop: the released schedule with `REFINER_STEPS` steps at shift `REFINER_SHIFT`
(timesteps 999, 952, 882, 768, 555), flow UniPC, and at every step two refiner forwards
(prompt and negative prompt) combined as `v_u + REFINER_GUIDANCE (v_c - v_u)`. The refiner
never sees the time. The audio is the preview's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from headmoe.config import check_positive_int, is_int
from headmoe.distributed.context import ParallelContext
from headmoe.models.refiner import Magi2Refiner
from headmoe.models.refiner.config import RELEASED_EVALUATION
from headmoe.pipeline.health import REFINER_HINT, check_media
from headmoe.pipeline.latents import SPATIAL_STRIDE
from headmoe.pipeline.recipe import RESOLUTIONS
from headmoe.pipeline.request import MAX_INFERENCE_STEPS, MAX_SIDE
from headmoe.pipeline.sampler import Schedule, UniPCSampler, cfg_combine, released_schedule

#: the refiner's released evaluation fields (REFINER.md section 2; their home is
#: `headmoe.models.refiner.config.RELEASED_EVALUATION`, which a nested config is checked by)
REFINER_STEPS: int = RELEASED_EVALUATION["magi2_refiner_num_inference_steps"]
REFINER_SHIFT: float = RELEASED_EVALUATION["magi2_refiner_shift"]
REFINER_GUIDANCE: float = RELEASED_EVALUATION["magi2_refiner_video_txt_guidance_scale"]
REFINER_NOISE_INDEX: int = RELEASED_EVALUATION["magi2_refiner_noise_value"]
#: latent frames per preview frame interval (the refined clip has 2T - 1 latent frames at
#: twice the preview's fps); a refiner latent cell is `SPATIAL_STRIDE` pixels, as the
#: preview's (the decoders' rule, `headmoe.pipeline.latents`)
REFINER_FPS_FACTOR = 2
#: limits of a request's refiner size (pixels) and steps: the request's own side and step
#: limits (`headmoe.pipeline.request`)
MAX_REFINER_SIDE = MAX_SIDE
MAX_REFINER_STEPS = MAX_INFERENCE_STEPS
#: the refined clip's size at the 1080p preset (height, width): the preset's own size
REFINER_SIZE = RESOLUTIONS["1080p"]


def zero_snr_table(steps: int = 1000) -> torch.Tensor:
    """`[steps]` fp32 signal coefficients of the zero-terminal-SNR DDPM table, index i =
    DDPM step i: betas = linspace(sqrt(0.00085), sqrt(0.012))^2 and their cumulative
    product in float64, then r = sqrt(alpha_bar) in float32, rescaled to
    (r - r_last) * (r_0 / (r_0 - r_last)) in float32 (golden `zero_snr.table`, bitwise)."""
    check_positive_int("steps", steps)
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, steps, dtype=torch.float64) ** 2
    alpha_bar = torch.cumprod(1.0 - betas, dim=0).to(torch.float32)
    r = alpha_bar.sqrt()
    first, last = r[0].clone(), r[-1].clone()
    return (r - last) * (first / (first - last))


def renoise_signal() -> torch.Tensor:
    """The re-noise signal coefficient s, a 0-dim fp32 tensor (0.8389104)."""
    return zero_snr_table()[REFINER_NOISE_INDEX]


def refiner_latent_thw(preview_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The refiner's latent `(2T - 1, height // 16, width // 16)` for a preview latent of
    T frames and a refiner size in pixels."""
    return (REFINER_FPS_FACTOR * (preview_frames - 1) + 1, height // SPATIAL_STRIDE,
            width // SPATIAL_STRIDE)


def upsample_preview(latent: torch.Tensor, thw: tuple[int, int, int]) -> torch.Tensor:
    """Trilinear resize (align_corners=True, fp32) of a preview latent `[C, T, H, W]` to
    `[C, *thw]`."""
    return F.interpolate(latent.float()[None], size=tuple(thw), mode="trilinear",
                         align_corners=True)[0]


def renoise(upsampled: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`upsampled * s + noise * (1 - s^2)^0.5` in fp32 (same shapes)."""
    s = renoise_signal()
    return upsampled * s + noise * (1 - s**2) ** 0.5


def refiner_schedule(steps: int = REFINER_STEPS) -> Schedule:
    """The refiner's schedule: the released one with `steps` steps at shift 5 (timesteps
    999, 952, 882, 768, 555 for 5 steps)."""
    return released_schedule(steps, REFINER_SHIFT)


def refiner_sampler(steps: int = REFINER_STEPS) -> UniPCSampler:
    """A fresh released flow-UniPC sampler over `refiner_schedule`."""
    return UniPCSampler(refiner_schedule(steps))


#: `predict(x)` -> (v_cond, v_uncond): the two refiner forwards of one step, fp32, x's shape
Predict = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def refine_latent(
    predict: Predict, x: torch.Tensor, sampler: UniPCSampler, steps: int,
    guidance: float = REFINER_GUIDANCE,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The refine loop from the re-noised latent `x` (any shape, fp32): `steps` sampler
    steps, each `sampler.step(i, x, v_u + guidance (v_c - v_u))`. Returns the final latent
    and the step times (s). Elementwise arithmetic on identical inputs: every rank that
    runs it gets the same bits."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        v_cond, v_uncond = predict(x)
        x = sampler.step(i, x, cfg_combine(v_cond, v_uncond, guidance))
        check_media(f"after refiner step {i + 1}/{steps}", REFINER_HINT,
                    **{"refined latent": x})  # the same bits on every rank
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(i + 1, steps)
    return x, times


@dataclass(frozen=True)
class RefinerStage:
    """The refiner stage of a request: the refined clip's size in pixels (multiples of 16;
    1088 x 1920 at 1080p) and its sampler steps. Refusals name the request field."""

    height: int = REFINER_SIZE[0]
    width: int = REFINER_SIZE[1]
    steps: int = REFINER_STEPS

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            v = getattr(self, name)
            if not is_int(v) or v < SPATIAL_STRIDE or v % SPATIAL_STRIDE \
                    or v > MAX_REFINER_SIDE:
                raise ValueError(f"refiner_{name}={v!r} must be a multiple of "
                                 f"{SPATIAL_STRIDE} in [{SPATIAL_STRIDE}, "
                                 f"{MAX_REFINER_SIDE}]")
        if not is_int(self.steps) or not 1 <= self.steps <= MAX_REFINER_STEPS:
            raise ValueError(f"refiner_steps={self.steps!r} must be an integer in "
                             f"[1, {MAX_REFINER_STEPS}]")

    def latent_thw(self, preview_frames: int) -> tuple[int, int, int]:
        return refiner_latent_thw(preview_frames, self.height, self.width)

    def to_dict(self) -> dict[str, int]:
        return {"refiner_height": self.height, "refiner_width": self.width,
                "refiner_steps": self.steps}

    @classmethod
    def from_dict(cls, fields: dict[str, int]) -> RefinerStage:
        """The stage of a `to_dict` result (re-checked)."""
        return cls(fields["refiner_height"], fields["refiner_width"], fields["refiner_steps"])


def refiner_predict(ctx: ParallelContext, model: Magi2Refiner, texts: list[torch.Tensor]
                    ) -> Predict:
    """The two forwards of a step on this rank's layout: both in turn (CFG 1, each its own
    forward: the refiner never packs branches), or this rank's branch (CFG rank 0 = prompt,
    1 = negative prompt) and one all-gather of the velocities over the CFG group."""

    def predict(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx.topology.cfg == 1:
            return model(x, texts[0]), model(x, texts[1])
        mine = model(x, texts[ctx.coords.cfg]).contiguous()
        got = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(got, mine, group=ctx.group("cfg"))
        return got[0], got[1]

    return predict


def refine_stage(
    ctx: ParallelContext, model: Magi2Refiner, preview: torch.Tensor, texts: list[torch.Tensor],
    generator: torch.Generator, height: int, width: int, steps: int = REFINER_STEPS,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The refiner stage on one rank: the preview's final video latent `[T, H, W, C]` ->
    the refined latent `[2T - 1, height // 16, width // 16, C]` fp32 on its device, and the
    step times. The noise `[1, C, 2T - 1, H', W']` is the next draw of `generator` (the
    request's, after the preview's noise, on its device); texts: prompt and negative-prompt
    features `[L, C_t]`. Identical inputs on every rank give identical bits."""
    thw = refiner_latent_thw(preview.shape[0], height, width)
    if min(thw) < 1:
        raise ValueError(f"refiner latent {thw} for refiner size {height}x{width} is empty; "
                         f"refiner height and width must be at least {SPATIAL_STRIDE}")
    up = upsample_preview(preview.permute(3, 0, 1, 2), thw)
    noise = torch.randn((1, *up.shape), generator=generator, device=generator.device)
    noise = noise[0].to(up.device)
    x = renoise(up, noise)
    x, times = refine_latent(refiner_predict(ctx, model, texts), x, refiner_sampler(steps),
                             steps, REFINER_GUIDANCE, on_step)
    return x.permute(1, 2, 3, 0).contiguous(), times
