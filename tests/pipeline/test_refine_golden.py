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
    refiner_latent_thw,
    renoise,
    renoise_signal,
    upsample_preview,
    zero_snr_table,
)
from tests.goldens import golden_file
from tests.models.refiner_golden import TOL, golden_json, golden_model, load_case, max_abs


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


def test_zero_snr_table_bitwise():
    sched = load_file(golden_file("magi2_refiner", "schedules.safetensors"))
    assert torch.equal(zero_snr_table(), sched["zero_snr.table"])


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
