"""headmoe's denoising loop against the released one (golden/magi2_pipeline part (b), cases
``denoise_t2v_a`` and ``denoise_t2v_b``): the noise draw, the step-0 packed sequence
(bitwise), the model time, the transformer's predictions per step (step 0 <= 2e-5), the
guided velocities, the latents after every step and the final latents (<= 1e-3), all
through headmoe's own `draw_noise`, `denoise`, packing and transformer (fp32, one rank)."""

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from headmoe.distributed import ParallelContext
from headmoe.models.magi2 import Magi2Transformer, load_checkpoint, pack_branches
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.interfaces import Components
from headmoe.pipeline.job import GenerateJob, Noise, denoise, draw_noise
from headmoe.pipeline.request import GenerateRequest
from headmoe.release.components import Magi2Denoiser
from tests.goldens import golden_file
from tests.models.golden import golden_config, golden_weights, max_abs
from tests.pipeline.released_loop import TIME_TOKENS_TOL, Recorder, check_loop, video

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

CASES = ("t2v_a", "t2v_b")
STEPS = 3


def _load(case: str) -> tuple[dict[str, torch.Tensor], int]:
    """The case's tensors and its seed (``cases.json``)."""
    cases = json.loads(golden_file("magi2_pipeline", "cases.json").read_text())
    seed = cases["denoise"][case]["make_denoise_inputs"]["seed"]
    return load_file(golden_file("magi2_pipeline", f"denoise_{case}.safetensors")), seed


@dataclass
class _Shapes:
    """Decoders that only state the golden latent sizes (for `draw_noise`)."""

    thw: tuple[int, int, int]
    audio_len: int
    latent_channels: int = 48
    sample_rate: int = 44100

    def latent_shape(self, num_frames, height, width):
        return self.thw

    def latent_length(self, duration_s):
        return self.audio_len


@pytest.fixture(scope="module")
def model():
    m = Magi2Transformer(golden_config(), dtype=torch.float32)
    load_checkpoint(m, golden_weights())
    return m.eval()


def _request(seed: int) -> GenerateRequest:
    return GenerateRequest(prompt="golden", num_inference_steps=STEPS, shift=7.0, seed=seed,
                           guidance_scale=5.0, audio_guidance_scale=7.0)


@pytest.mark.parametrize("case", CASES)
def test_noise_is_the_released_draw(case):
    d, seed = _load(case)
    _, c, t, h, w = d["in.video_noise"].shape
    shapes = _Shapes((t, h, w), d["in.audio_noise"].shape[1])
    audio = _Shapes((t, h, w), shapes.audio_len, latent_channels=64)
    parts = Components(None, None, shapes, audio)
    noise = draw_noise(ParallelContext.single(), _request(seed), parts)
    assert torch.equal(noise.video, video(d["in.video_noise"][0]))
    assert torch.equal(noise.audio, d["in.audio_noise"][0])


@pytest.fixture(scope="module", params=CASES)
def run(request, model):
    """One golden case through `denoise`: (golden tensors, recorded calls, final latents)."""
    d, seed = _load(request.param)
    rec = Recorder(Magi2Denoiser(model))
    parts = Components(rec, None, None, None)
    job = GenerateJob(deployment=Deployment(model_config=None, parallel=None),
                      request=_request(seed), output=None, progress=False)
    noise = Noise(seed, video(d["in.video_noise"][0]), d["in.audio_noise"][0].clone(), 1)
    texts = [d["in.txt_feat"][0], d["in.null_txt_feat"][0]]
    xv, xa, _ = denoise(ParallelContext.single(), job, parts, noise, texts)
    return d, rec.calls, (xv, xa)


def test_step0_packed_sequence_bitwise(run):
    d, calls, _ = run
    packed = pack_branches(calls[0][0], golden_config())
    assert torch.equal(packed.x, d["step0.packed.x"])
    assert torch.equal(packed.coords, d["step0.packed.coords"])
    assert torch.equal(packed.modality, d["step0.packed.modality"].long())
    assert torch.equal(packed.cu_seqlens, d["step0.packed.cu_seqlens"].long())
    assert max_abs(packed.time_tokens, d["step0.packed.time_tokens"]) <= TIME_TOKENS_TOL


def test_model_time_is_the_integer_timestep(run):
    d, calls, _ = run
    assert d["sched.timesteps"].tolist() == [999, 933, 777]
    for i, (branches, _) in enumerate(calls):
        want = d[f"step{i}.model_t"]
        for br in branches:
            got = torch.tensor([br.t_video, br.t_audio], dtype=torch.float32)
            assert torch.equal(got, want.expand(2)), i


def test_predictions_guidance_and_latents_per_step(run):
    d, calls, final = run
    check_loop(d, calls, final, STEPS)
