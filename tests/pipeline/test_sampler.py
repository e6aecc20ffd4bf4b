"""Samplers against closed-form flow-matching ODE solutions."""

import math

import pytest
import torch

from headmoe.pipeline.sampler import (
    EulerSampler,
    UniPCSampler,
    cfg_combine,
    flow_sigmas,
    make_sampler,
)


def _lam(s):
    return math.log((1 - s) / s)


def test_flow_sigmas_shift_and_grid():
    sig = flow_sigmas(4, shift=1.0, num_train_timesteps=1000)
    assert sig == pytest.approx([0.999, 0.74925, 0.4995, 0.24975, 0.0], abs=1e-15)
    shifted = flow_sigmas(4, shift=7.0)
    for a, b in zip(sig, shifted):
        assert b == pytest.approx(7 * a / (1 + 6 * a), abs=1e-15)
    assert shifted[-1] == 0.0 and all(x > y for x, y in zip(shifted, shifted[1:]))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_steps": 0}, "num_steps"), ({"num_steps": 2, "shift": 0.0}, "shift")],
)
def test_flow_sigmas_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        flow_sigmas(**kwargs)


def test_make_sampler_rejects_unknown_name():
    with pytest.raises(ValueError, match="sampler must be one of .* got 'ddim'"):
        make_sampler("ddim", flow_sigmas(3))


def test_unipc_rejects_out_of_order_steps():
    smp = UniPCSampler(flow_sigmas(3))
    with pytest.raises(ValueError, match="step index must be 0"):
        smp.step(1, torch.zeros(2), torch.zeros(2))


def _run(name, sigmas, x, velocity):
    smp = make_sampler(name, sigmas)
    out = []
    for i in range(len(sigmas) - 1):
        x = smp.step(i, x, velocity(x, sigmas[i]))
        out.append(x)
    return out


@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_single_point_data_is_integrated_exactly(name):
    # One data point x0: v = (x - x0) / sigma; trajectories are straight lines.
    x0 = torch.tensor([0.25, -1.5, 3.0], dtype=torch.float64)
    start = torch.tensor([1.0, -0.2, 0.7], dtype=torch.float64)
    sig = flow_sigmas(7)
    noise = (start - (1 - sig[0]) * x0) / sig[0]
    states = _run(name, sig, start.clone(), lambda x, s: (x - x0) / s)
    for i, x in enumerate(states):
        exact = (1 - sig[i + 1]) * x0 + sig[i + 1] * noise
        assert torch.allclose(x, exact, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shift", [1.0, 7.0])
def test_unipc_exact_when_data_prediction_is_linear_in_lambda(shift):
    # v(x, s) = (x - m(s)) / s with m = c0 + c1 * lambda(s): a linear ODE whose solution is
    # x_t = (s_t/s_s) x_s + a_t F(l_t) - s_t a_s / s_s F(l_s), F(l) = c0 + c1 (l - 1).
    # The first step is order 1; the UniC correction and the order-2 steps after it are
    # exact for this m, so every state from sigma_2 on matches to rounding (not Euler).
    c0, c1 = 0.3, -0.2
    sig = flow_sigmas(12, shift)
    start = torch.tensor([1.0, -0.5], dtype=torch.float64)

    def exact(t):
        f = lambda s: c0 + c1 * (_lam(s) - 1)  # noqa: E731
        return (t / sig[0]) * start + (1 - t) * f(t) - t * (1 - sig[0]) / sig[0] * f(sig[0])

    vel = lambda x, s: (x - (c0 + c1 * _lam(s))) / s  # noqa: E731
    uni = _run("unipc", sig, start.clone(), vel)
    eul = _run("euler", sig, start.clone(), vel)
    for i in range(1, 11):  # states at sigma_2 .. sigma_11 (the last step lands on lambda=inf)
        assert torch.allclose(uni[i], exact(sig[i + 1]), atol=1e-12, rtol=0)
    assert (eul[5] - exact(sig[6])).abs().max() > 1e-3
    assert (uni[0] - exact(sig[1])).abs().max() > 1e-4  # the first step is only order 1


def _gaussian_errors(name, steps, shift):
    # Data ~ N(mu, s^2): E[x0 | x] is linear in x and the probability-flow solution is
    # x_sigma = (1 - sigma) mu + sqrt((1 - sigma)^2 s^2 + sigma^2) z.
    mu, s = 0.5, 0.5

    def vel(x, sg):
        a = 1 - sg
        m = mu + a * s * s / (a * a * s * s + sg * sg) * (x - a * mu)
        return (x - m) / sg

    start = torch.linspace(-2, 2, 9, dtype=torch.float64)
    errs = []
    for n in steps:
        sig = flow_sigmas(n, shift)
        a0 = 1 - sig[0]
        z = (start - a0 * mu) / math.sqrt(a0 * a0 * s * s + sig[0] ** 2)
        end = _run(name, sig, start.clone(), vel)[-1]
        errs.append((end - (mu + s * z)).abs().max().item())
    return [math.log2(errs[i] / errs[i + 1]) for i in range(len(errs) - 1)]


def test_convergence_orders():
    euler = _gaussian_errors("euler", [40, 80, 160], 1.0)
    unipc = _gaussian_errors("unipc", [40, 80, 160], 1.0)
    assert all(0.9 < o < 1.1 for o in euler), euler
    assert all(1.8 < o < 2.3 for o in unipc), unipc


def test_separate_states_for_video_and_audio():
    # Two latents stepped in alternation must equal each stepped alone: no shared history.
    sig = flow_sigmas(5)
    vel_a = lambda x, s: torch.sin(x) + s  # noqa: E731
    vel_b = lambda x, s: x * x - s  # noqa: E731
    alone_a = _run("unipc", sig, torch.tensor([0.3, -0.1]), vel_a)[-1]
    alone_b = _run("unipc", sig, torch.tensor([0.2, 0.9, 0.4]), vel_b)[-1]
    sa, sb = UniPCSampler(sig), UniPCSampler(sig)
    xa, xb = torch.tensor([0.3, -0.1]), torch.tensor([0.2, 0.9, 0.4])
    for i in range(5):
        xa, xb = sa.step(i, xa, vel_a(xa, sig[i])), sb.step(i, xb, vel_b(xb, sig[i]))
    assert torch.equal(xa, alone_a) and torch.equal(xb, alone_b)


def test_euler_step_formula():
    sig = [0.9, 0.5, 0.0]
    smp = EulerSampler(sig)
    x, v = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    assert torch.equal(smp.step(0, x, v), torch.tensor([1.0 - 0.4 * 0.5, 2.0 + 0.4]))


def test_cfg_combine():
    vc, vu = torch.tensor([1.0, 3.0]), torch.tensor([0.5, 1.0])
    assert torch.equal(cfg_combine(vc, vu, 5.0), torch.tensor([3.0, 11.0]))
    assert torch.equal(cfg_combine(vc, vu, 1.0), vc)
