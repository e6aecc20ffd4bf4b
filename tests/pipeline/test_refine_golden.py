"""The refiner stage against golden/magi2_refiner (refine_loop, schedules): the
zero-terminal-SNR table and the handoff bitwise, every step's two refiner forwards
(<= 1e-4), and the refine loop end to end (<= 1e-4)."""

import pytest
import torch
from safetensors.torch import load_file

from headmoe.pipeline.refine import (
    REFINER_GUIDANCE,
    REFINER_NOISE_INDEX,
    REFINER_SHIFT,
    REFINER_STEPS,
    refine_latent,
    refiner_latent_thw,
    refiner_sampler,
    refiner_schedule,
    renoise,
    renoise_signal,
    upsample_preview,
    zero_snr_table,
)
from headmoe.pipeline.sampler import cfg_combine
from tests.goldens import cross_cpu_bar, golden_file
from tests.models.refiner_golden import TOL, golden_json, golden_model, load_case, max_abs

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden


@pytest.fixture(scope="module")
def loop():
    return load_case("refine_loop")


@pytest.fixture(scope="module")
def model():
    return golden_model(torch.float32)


def test_released_evaluation_fields():
    ev = golden_json("config.json")["evaluation"]
    assert ev["magi2_refiner_num_inference_steps"] == REFINER_STEPS
    assert ev["magi2_refiner_shift"] == REFINER_SHIFT
    assert ev["magi2_refiner_video_txt_guidance_scale"] == REFINER_GUIDANCE
    assert ev["magi2_refiner_noise_value"] == REFINER_NOISE_INDEX


def test_zero_snr_table():
    # README: bitwise in its order on the CPU that made it, <= 1e-6 otherwise; the table's
    # float32 sqrt moves between CPUs (golden/CROSS_CPU.md: 172 of 1000 entries by 1.2e-7)
    sched = load_file(golden_file("magi2_refiner", "schedules.safetensors"))
    bar = cross_cpu_bar("magi2_refiner", "zero_snr.table")
    assert max_abs(zero_snr_table(), sched["zero_snr.table"]) <= bar


def test_handoff_bitwise(loop):
    case = golden_json("cases.json")["cases"]["refine_loop"]
    thw = refiner_latent_thw(loop["in.preview_latent"].shape[2], *case["refiner_px_hw"])
    assert list(thw) == case["refiner_latent_thw"]
    up = upsample_preview(loop["in.preview_latent"][0], thw)
    assert torch.equal(up, loop["handoff.upsampled"][0])
    assert torch.equal(renoise_signal().reshape(1), loop["handoff.sigma"])
    assert torch.equal(renoise(up, loop["handoff.noise"][0]), loop["handoff.renoised"][0])


def test_every_step_forward(loop, model):
    """Both forwards of every step from the golden latent entering it (the model part of
    the loop, independent of the sampler)."""
    ctx, null = loop["in.context"][0], loop["in.context_null"][0]
    for k in range(REFINER_STEPS):
        x = loop["handoff.renoised" if k == 0 else f"step{k - 1}.latent"][0]
        assert max_abs(model(x, ctx), loop[f"step{k}.v_cond"][0]) <= TOL, k
        assert max_abs(model(x, null), loop[f"step{k}.v_uncond"][0]) <= TOL, k


def test_schedule_exact():
    sched = load_file(golden_file("magi2_refiner", "schedules.safetensors"))
    ours = refiner_schedule()
    assert torch.equal(ours.timesteps, sched["refiner.timesteps"])
    assert ours.timesteps.tolist() == [999, 952, 882, 768, 555]
    assert torch.equal(ours.sigmas, sched["refiner.sigmas"])


def test_sampler_steps_from_the_stored_velocities(loop):
    """The released UniPC (pipeline.sampler, shared with the preview) on the refiner's
    schedule reproduces every stored latent from the stored velocities: bitwise on the CPU
    that made the data, and within the bar of the same sampler's trajectories on any CPU
    (golden/CROSS_CPU.md; the README's loop bar is 1e-4; 2.4e-7 measured on an Intel
    Xeon)."""
    bar = cross_cpu_bar("magi2_pipeline", "scheduler trajectories (scheduler.safetensors)")
    sampler, x = refiner_sampler(), loop["handoff.renoised"][0]
    for k in range(REFINER_STEPS):
        v = cfg_combine(loop[f"step{k}.v_cond"][0], loop[f"step{k}.v_uncond"][0],
                        REFINER_GUIDANCE)
        x = sampler.step(k, x, v)
        assert max_abs(x, loop[f"step{k}.latent" if k < 4 else "out.latent"][0]) <= bar, k


def test_refine_loop_end_to_end(loop, model):
    """Handoff from the preview latent (with the recorded noise), 5 CFG steps = 10
    forwards, final latent: <= 1e-4."""
    case = golden_json("cases.json")["cases"]["refine_loop"]
    up = upsample_preview(loop["in.preview_latent"][0],
                          refiner_latent_thw(2, *case["refiner_px_hw"]))
    x = renoise(up, loop["handoff.noise"][0])
    texts = (loop["in.context"][0], loop["in.context_null"][0])
    calls = []

    def predict(latent):
        calls.append(latent)
        return model(latent, texts[0]), model(latent, texts[1])

    out, times = refine_latent(predict, x, refiner_sampler(), REFINER_STEPS)
    assert len(calls) == 5 and len(times) == 5
    for k in range(1, REFINER_STEPS):
        assert max_abs(calls[k], loop[f"step{k - 1}.latent"][0]) <= TOL, k
    assert max_abs(out, loop["out.latent"][0]) <= TOL
