"""The released MAGI-2 sampler: schedule, integer model time, UniPC with the fixed rho, CFG.

This is the function of MAGI2.md section 6.1-6.4, judged bit for bit by
``golden/magi2_pipeline/scheduler.safetensors`` (see its README, part (a)).

Conventions
-----------
A latent at noise level sigma in [0, 1] is ``x = (1 - sigma) * x0 + sigma * noise``; the
model predicts the velocity ``v = noise - x0``. With ``alpha = 1 - sigma`` the data
prediction is ``m = x - sigma * v`` and ``lambda = log(alpha) - log(sigma)`` grows as sigma
falls (``+inf`` at the final sigma 0).

Schedule (`released_schedule`)
------------------------------
``s = linspace(sigma_max, 0, n + 1)[:-1]`` in float64 with ``sigma_max = float32(1 - 1/1000)``
read back as a Python float, shifted ``s' = shift s / (1 + (shift - 1) s)`` (float64); the
integer timesteps are ``int64(1000 s')`` (truncated, before any float32 cast) and the sigmas
``float32(s' ++ [0])``. The transformer is given ``float32(t) / 1000`` (float32), i.e. the
integer timestep, not ``1000 sigma``.

UniPC step (`UniPCSampler`; Zhao et al. 2023, "UniPC", data prediction, the "bh2" weights)
-----------------------------------------------------------------------------------------
All scalars are float32 0-dim tensors. For a step from sigma_s to sigma_t:
``h = lambda_t - lambda_s``, ``hh = -h``, ``h_phi_1 = expm1(hh)``, ``B_h = expm1(hh)`` and the
first-order part ``x_t' = (sigma_t / sigma_s) x - (alpha_t h_phi_1) m_s``.

- Predictor, order 1: ``x_t = x_t' - (alpha_t B_h) 0``; order 2 (one earlier point k):
  ``r = (lambda_k - lambda_s) / h``, ``D = (m_k - m_s) / r`` and the **fixed** ``rho = 0.5``:
  ``x_t = x_t' - (alpha_t B_h) (rho D)``.
- Corrector (UniC), from the second step on, before the predictor, on the step just taken
  (s = i - 1 to t = i) with the new model output ``m_t``, at the order the previous
  predictor used. Order 1: ``x_t = x_t' - (alpha_t B_h) (0 + 0.5 (m_t - m_s))``. Order 2:
  ``rho = solve(R, b)`` (float32, ``torch.linalg.solve``) with ``R = [[1, 1], [r, 1]]``,
  ``b_1 = (h_phi_1 / hh - 1) / B_h``, ``b_2 = 2 ((h_phi_1 / hh - 1) / hh - 1/2) / B_h``;
  ``x_t = x_t' - (alpha_t B_h) (rho_1 D + rho_2 (m_t - m_s))``.
- Orders 1, 2, ..., 2, 1: step ``i`` of ``n`` uses ``min(2, n - i, i + 1)``. The last step
  (to sigma 0: ``h_phi_1 = B_h = -1``) returns the data prediction of its corrected input.

Every update is elementwise on the latents with host-side scalars, so every rank that holds
the same inputs gets the same bits, on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from headmoe.config import is_int, is_number

#: sampler names: the released UniPC is the only one (`--sampler`)
SAMPLERS: tuple[str, ...] = ("unipc",)
#: training timesteps of the released scheduler
NUM_TRAIN_TIMESTEPS = 1000
#: the released fixed UniPC coefficient (order-2 predictor and order-1 corrector)
FIXED_RHO = 0.5
SOLVER_ORDER = 2


@dataclass(frozen=True)
class Schedule:
    """``timesteps [n]`` int64 (the integer model times) and ``sigmas [n + 1]`` float32
    (decreasing, last 0), on the CPU."""

    timesteps: torch.Tensor
    sigmas: torch.Tensor

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    def model_time(self, i: int) -> float:
        """Diffusion time the transformer receives at step ``i``: ``float32(t_i) / 1000``
        computed in float32 (the time sinusoid multiplies it back by 1000 in float32)."""
        t = self.timesteps[i].to(torch.float32) / NUM_TRAIN_TIMESTEPS
        return float(t)

    def sigma(self, i: int) -> float:
        """``sigmas[i]`` as a Python float (for messages)."""
        return float(self.sigmas[i])


def released_schedule(num_steps: int, shift: float = 7.0,
                      num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Schedule:
    """The released flow-matching schedule of ``num_steps`` steps (see module doc).

    Raises `ValueError` naming the argument for ``num_steps < 1``, ``shift <= 0`` or
    ``num_train_timesteps < 2``."""
    if not is_int(num_steps) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not is_number(shift) or not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a positive number, got {shift!r}")
    if not is_int(num_train_timesteps) or num_train_timesteps < 2:
        raise ValueError(f"num_train_timesteps must be an int >= 2, got {num_train_timesteps!r}")
    sigma_max = float(np.float32(1.0 - 1.0 / num_train_timesteps))
    s = np.linspace(sigma_max, 0.0, num_steps + 1)[:-1]
    shift = float(shift)
    s = shift * s / (1 + (shift - 1) * s)
    timesteps = torch.from_numpy(s * num_train_timesteps).to(torch.int64)
    sigmas = torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32))
    return Schedule(timesteps, sigmas)


def _lambda(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, lambda) of one 0-dim float32 sigma."""
    alpha = 1 - sigma
    return alpha, torch.log(alpha) - torch.log(sigma)


class UniPCSampler:
    """The released UniPC multistep scheduler (order 2) for one latent tensor of any shape
    in float32. Keeps its own history: use one instance per latent (video, audio)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.sigmas = schedule.sigmas
        self._m: dict[int, torch.Tensor] = {}  # data predictions at the last two sigmas
        self._last_sample: torch.Tensor | None = None  # the corrected start of the last step
        self._last_order = 0
        self._next = 0

    def _first_order(self, s: int, t: int, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
        """``(x_t', alpha_t B_h, h, h_phi_1, hh)`` of the step from sigmas[s] to sigmas[t]."""
        sigma_s, sigma_t = self.sigmas[s], self.sigmas[t]
        alpha_t, lambda_t = _lambda(sigma_t)
        _, lambda_s = _lambda(sigma_s)
        h = lambda_t - lambda_s
        hh = -h
        h_phi_1 = torch.expm1(hh)
        b_h = torch.expm1(hh)
        x_first = sigma_t / sigma_s * x - alpha_t * h_phi_1 * self._m[s]
        return x_first, alpha_t * b_h, h, h_phi_1, hh

    def _difference(self, k: int, s: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(r, D)``: ``r = (lambda_k - lambda_s) / h`` and ``D = (m_k - m_s) / r``."""
        r = (_lambda(self.sigmas[k])[1] - _lambda(self.sigmas[s])[1]) / h
        return r, (self._m[k] - self._m[s]) / r

    def _correct(self, i: int, m_t: torch.Tensor) -> torch.Tensor:
        """UniC over the step from sigmas[i-1] to sigmas[i] with the new prediction ``m_t``."""
        s = i - 1
        last = cast(torch.Tensor, self._last_sample)  # set by the step before (i >= 1)
        x_first, scale, h, h_phi_1, hh = self._first_order(s, i, last)
        d_t = m_t - self._m[s]
        if self._last_order == 1:
            return x_first - scale * (0 + torch.tensor(FIXED_RHO) * d_t)
        r, d = self._difference(s - 1, s, h)
        b_h = torch.expm1(hh)
        phi = h_phi_1 / hh - 1
        b1 = phi * 1 / b_h
        phi = phi / hh - 1 / 2
        b2 = phi * 2 / b_h
        rks = torch.tensor([float(r), 1.0])
        lhs = torch.stack([torch.pow(rks, 0), torch.pow(rks, 1)])
        rho: torch.Tensor = torch.linalg.solve(lhs, torch.tensor([float(b1), float(b2)]))
        return x_first - scale * (rho[0] * d + rho[-1] * d_t)

    def _predict(self, i: int, x: torch.Tensor, order: int) -> torch.Tensor:
        """UniP from sigmas[i] to sigmas[i+1] at ``order`` (1 or 2)."""
        x_first, scale, h, _, _ = self._first_order(i, i + 1, x)
        if order == 1:
            return x_first - scale * 0
        _, d = self._difference(i - 1, i, h)
        return x_first - scale * (torch.tensor(FIXED_RHO) * d)

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Advance from ``sigmas[i]`` to ``sigmas[i + 1]``: ``x`` the sample the model saw,
        ``v`` its (guided) velocity, same shape, float32. Steps run in order from 0."""
        if i != self._next:
            raise ValueError(f"step index must be {self._next} (steps run in order), got {i!r}")
        n = self.schedule.num_steps
        if i >= n:
            raise ValueError(f"step index must be below num_steps={n}, got {i!r}")
        self._next += 1
        m = x - self.sigmas[i] * v
        if i > 0:
            x = self._correct(i, m)
        self._m[i] = m
        self._m.pop(i - 2, None)
        order = min(SOLVER_ORDER, n - i, i + 1)
        self._last_sample, self._last_order = x, order
        return self._predict(i, x, order).to(x.dtype)


def make_sampler(name: str, schedule: Schedule) -> UniPCSampler:
    """A fresh sampler over ``schedule``; raises `ValueError` naming ``sampler`` for a name
    not in `SAMPLERS`."""
    if name == "unipc":
        return UniPCSampler(schedule)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``v_u + scale * (v_c - v_u)``; same shape and dtype as the
    inputs (any shape, fp32). Elementwise, so identical inputs give identical bits anywhere."""
    return v_uncond + scale * (v_cond - v_uncond)
