"""Flow-matching samplers: shifted sigma schedule, Euler, and UniPC multistep (order 2).

Conventions (MAGI2.md section 4)
--------------------------------
A latent at noise level sigma in [0, 1] is ``x = (1 - sigma) * x0 + sigma * noise``; the model
predicts the velocity ``v = dx/dsigma = noise - x0``. Sampling integrates from the first sigma
(almost 1) down to 0. With ``alpha = 1 - sigma`` the data prediction is ``m = x - sigma * v``
and the log signal-to-noise ratio ``lambda = log(alpha / sigma)`` grows as sigma falls.

Schedule: ``num_train_timesteps`` training steps; the base grid is
``sigma_j = (1 - 1 / num_train_timesteps) * j / n`` for ``j = n, ..., 1``, each shifted with
``sigma' = shift * sigma / (1 + (shift - 1) * sigma)``, then a final 0.

UniPC (Zhao et al., 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling
of Diffusion Models"), data-prediction form, derived here for the flow-matching
parametrisation. The exact solution from ``s`` to ``t`` is

    x_t = (sigma_t / sigma_s) x_s + sigma_t * integral_{lambda_s}^{lambda_t} e^lambda m(lambda) dlambda.

With ``h = lambda_t - lambda_s`` and ``m`` expanded around ``lambda_s`` as
``m_s + u m' + u^2 / 2 m''`` the integral gives
``alpha_t [(1 - e^-h) m_s + g1 m' + g2 m'']`` with ``g1 = h - 1 + e^-h`` and
``g2 = h^2 / 2 - h + 1 - e^-h``. UniPC replaces the derivatives by differences
``D_k = m_k - m_s`` at earlier (or, for the corrector, later) points ``r_k = (lambda_k -
lambda_s) / h`` with weights ``B(h) * rho_k`` (``B(h) = 1 - e^-h``, the paper's "bh2"), and
picks ``rho`` so that the expansion matches to the order used:

- predictor UniP-2 (one earlier point ``r_1 < 0``): ``rho_1 r_1 = g1 / (h B)``;
- corrector UniC (the earlier point and the new one at ``r = 1``): ``sum rho_k r_k = g1 / (h B)``
  and ``sum rho_k r_k^2 = 2 g2 / (h^2 B)``; with no earlier point only the first equation.

The corrector uses the model output at the predicted point, so it costs no extra model call;
the corrected sample starts the next step. The first step has no history (order 1) and the
last step (to sigma = 0, where lambda is infinite) is order 1: it returns the data
prediction. All coefficients are Python floats computed from the schedule alone, and every
update is elementwise, so every rank that holds the same inputs gets the same bits.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from headmoe.config import is_int

SAMPLERS: tuple[str, ...] = ("unipc", "euler")


def shift_sigma(sigma: float, shift: float) -> float:
    """MAGI-2's time shift ``shift * sigma / (1 + (shift - 1) * sigma)`` of one sigma."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def flow_sigmas(num_steps: int, shift: float = 7.0, num_train_timesteps: int = 1000) -> list[float]:
    """The ``num_steps + 1`` sigmas of a shifted flow-matching schedule, decreasing to 0.

    Raises `ValueError` naming the argument for ``num_steps < 1``, ``shift <= 0`` or
    ``num_train_timesteps < 2``.
    """
    if not is_int(num_steps) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not (isinstance(shift, int | float) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a positive number, got {shift!r}")
    if not isinstance(num_train_timesteps, int) or num_train_timesteps < 2:
        raise ValueError(f"num_train_timesteps must be an int >= 2, got {num_train_timesteps!r}")
    top = 1.0 - 1.0 / num_train_timesteps
    base = [top * j / num_steps for j in range(num_steps, 0, -1)]
    return [shift_sigma(s, float(shift)) for s in base] + [0.0]


class Sampler(Protocol):
    """One latent's sampler state. ``sigmas`` has ``n + 1`` entries; call ``step(i, x, v)``
    for ``i = 0 .. n - 1`` in order with the sample ``x`` the model saw at ``sigmas[i]`` and
    its velocity ``v`` (same shape, fp32); it returns the sample at ``sigmas[i + 1]``."""

    sigmas: list[float]

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class EulerSampler:
    """First-order flow-matching Euler: ``x + (sigma_{i+1} - sigma_i) * v``. Any shape, fp32."""

    def __init__(self, sigmas: list[float]):
        self.sigmas = list(sigmas)

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return x + (self.sigmas[i + 1] - self.sigmas[i]) * v


def _lambda(sigma: float) -> float:
    """log(alpha / sigma); +inf at sigma = 0."""
    return math.log((1.0 - sigma) / sigma) if sigma > 0.0 else math.inf


class UniPCSampler:
    """UniPC multistep, order 2 (UniP-2 predictor + UniC corrector), for one latent tensor of
    any shape in fp32. Keeps its own history: use one instance per latent (video, audio)."""

    def __init__(self, sigmas: list[float]):
        self.sigmas = list(sigmas)
        if (
            any(not 0.0 <= s < 1.0 for s in self.sigmas)
            or self.sigmas[-1] != 0.0
            or any(a <= b for a, b in zip(self.sigmas, self.sigmas[1:]))
        ):
            raise ValueError(
                f"sigmas must decrease strictly in [0, 1) to a final 0, got {self.sigmas!r}"
            )
        self._m: list[torch.Tensor] = []  # data predictions at sigmas[0..i]
        self._x_start: torch.Tensor | None = None  # corrected sample the last step started from
        self._last_order = 0
        self._next = 0

    def _coeffs(self, s: int, t: int) -> tuple[float, float, float, float]:
        """(sigma_t / sigma_s, alpha_t, h, e^-h) for the step from sigmas[s] to sigmas[t]."""
        sg_s, sg_t = self.sigmas[s], self.sigmas[t]
        a_s, a_t = 1.0 - sg_s, 1.0 - sg_t
        return sg_t / sg_s, a_t, _lambda(sg_t) - _lambda(sg_s), (a_s * sg_t) / (sg_s * a_t)

    def _r(self, k: int, s: int, h: float) -> float:
        return (_lambda(self.sigmas[k]) - _lambda(self.sigmas[s])) / h

    def _update(
        self, s: int, t: int, x_s: torch.Tensor, diffs: list[tuple[float, torch.Tensor]]
    ) -> torch.Tensor:
        """x_t from x_s with the first-order term plus ``B(h) sum rho_k D_k`` (see module doc).
        ``diffs`` are (r_k, D_k); for the corrector the last one is the new point (r = 1)."""
        ratio, a_t, h, emh = self._coeffs(s, t)
        m_s = self._m[s]
        out = ratio * x_s + (a_t * (1.0 - emh)) * m_s
        if not diffs:
            return out
        b = 1.0 - emh
        g1 = (h - 1.0 + emh) / (h * b)
        if len(diffs) == 1:
            rhos = [g1 / diffs[0][0]]
        else:
            (r1, _), (r2, _) = diffs
            g2 = 2.0 * (h * h / 2.0 - h + 1.0 - emh) / (h * h * b)
            # rho1 r1 + rho2 r2 = g1 ; rho1 r1^2 + rho2 r2^2 = g2
            det = r1 * r2 * (r2 - r1)
            rhos = [(g1 * r2 * r2 - g2 * r2) / det, (g2 * r1 - g1 * r1 * r1) / det]
        for rho, (_, d) in zip(rhos, diffs):
            out = out + (a_t * b * rho) * d
        return out

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Advance from ``sigmas[i]`` to ``sigmas[i + 1]``. ``x``, ``v``: same shape, fp32."""
        if i != self._next:
            raise ValueError(f"step index must be {self._next} (steps run in order), got {i!r}")
        self._next += 1
        self._m.append(x - self.sigmas[i] * v)
        if i > 0:  # UniC: correct the sample the model just saw, using its own prediction
            s = i - 1
            h = self._coeffs(s, i)[2]
            diffs = [(1.0, self._m[i] - self._m[s])]
            if self._last_order == 2:
                diffs.insert(0, (self._r(s - 1, s, h), self._m[s - 1] - self._m[s]))
            x = self._update(s, i, self._x_start, diffs)
        last = i + 1 == len(self.sigmas) - 1
        order = 1 if i == 0 or last else 2
        diffs = []
        if order == 2:
            h = self._coeffs(i, i + 1)[2]
            diffs = [(self._r(i - 1, i, h), self._m[i - 1] - self._m[i])]
        self._x_start, self._last_order = x, order
        return self._update(i, i + 1, x, diffs)


def make_sampler(name: str, sigmas: list[float]) -> Sampler:
    """A fresh sampler ("unipc" or "euler") over ``sigmas``; raises `ValueError` naming
    ``sampler`` for another name."""
    if name == "unipc":
        return UniPCSampler(sigmas)
    if name == "euler":
        return EulerSampler(sigmas)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``v_u + scale * (v_c - v_u)``; same shape and dtype as the
    inputs (any shape, fp32). Elementwise, so identical inputs give identical bits anywhere."""
    return v_uncond + scale * (v_cond - v_uncond)
