"""Shared by the golden denoise-loop tests (``golden/magi2_pipeline`` part (b): the T2V and
I2V cases): layout conversion, a recording denoiser, and the per-step comparison."""

from __future__ import annotations

import torch

from headmoe.pipeline.sampler import cfg_combine
from tests.goldens import cross_cpu_bar
from tests.models.golden import max_abs

#: README (b) tolerances: the loop's; step 0's predictions and time tokens at the bars of
#: golden/CROSS_CPU.md (the README's 2e-5 and bitwise hold on the CPU that made the data)
LOOP_TOL = 1e-3
STEP0_PRED_TOL = cross_cpu_bar("magi2_pipeline", "step0.pred.*")
TIME_TOKENS_TOL = cross_cpu_bar("magi2_pipeline", "step0.packed.time_tokens")


def video(x: torch.Tensor) -> torch.Tensor:
    """Golden ``[C, T, H, W]`` -> headmoe ``[T, H, W, C]``."""
    return x.permute(1, 2, 3, 0).contiguous()


class Recorder:
    """`Denoiser` that records each call's branches and outputs."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, branches):
        out = self.inner(branches)
        self.calls.append((list(branches), out))
        return out


def check_loop(d: dict[str, torch.Tensor], calls: list, final: tuple, steps: int) -> None:
    """Every step's predictions (step 0 at `STEP0_PRED_TOL`), guided velocities (scales 5.0
    video, 7.0 audio) and latents, and the final latents, against the golden ``d``."""
    assert len(calls) == steps
    for i, (_, preds) in enumerate(calls):
        tol = STEP0_PRED_TOL if i == 0 else LOOP_TOL
        for b, (pv, pa) in enumerate(preds):  # row 0 cond, row 1 uncond
            assert max_abs(pv, video(d[f"step{i}.pred.video"][b])) <= tol, (i, b)
            assert max_abs(pa, d[f"step{i}.pred.audio"][b]) <= tol, (i, b)
        (vc, ac), (vu, au) = preds
        assert max_abs(cfg_combine(vc, vu, 5.0), video(d[f"step{i}.cfg.video"][0])) <= LOOP_TOL
        assert max_abs(cfg_combine(ac, au, 7.0), d[f"step{i}.cfg.audio"][0]) <= LOOP_TOL
        if i + 1 < steps:  # the latents after step i are what step i + 1 feeds the model
            nxt = calls[i + 1][0][0]
            assert max_abs(nxt.video, video(d[f"step{i}.latent.video"][0])) <= LOOP_TOL
            assert max_abs(nxt.audio, d[f"step{i}.latent.audio"][0]) <= LOOP_TOL
    xv, xa = final
    assert max_abs(xv, video(d["out.video"][0])) <= LOOP_TOL
    assert max_abs(xa, d["out.audio"][0]) <= LOOP_TOL
