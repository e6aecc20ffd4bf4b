"""Run-time health of a job (issue 13): full 63-bit seeds, non-finite values named by step
and stage, per-layer checks, text truncation in the sidecar. Fake components: fast."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from headmoe.distributed import ParallelContext
from headmoe.errors import NonFiniteError
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.health import check_step, text_report, watch_layers
from headmoe.pipeline.job import Components, GenerateJob, run_job
from headmoe.pipeline.request import GenerateRequest
from headmoe.pipeline.seeding import check_seed, seeded_generator
from headmoe.release.standins import ByteTextEncoder
from tests.pipeline.fake import fake_components

REQ = GenerateRequest(prompt="a cat", negative_prompt="", num_inference_steps=3)


def _job(components=fake_components, output=None, request=REQ):
    return GenerateJob(deployment=Deployment(model_config=None), request=request,
                       output=output, progress=False, components=components)


def _draw(seed: int) -> torch.Tensor:
    return torch.randn(64, generator=seeded_generator(seed))


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
def test_seeds_below_2_32_draw_what_manual_seed_draws(seed):
    assert torch.equal(_draw(seed), torch.randn(64, generator=torch.Generator().manual_seed(seed)))


def test_every_seed_bit_reaches_the_noise():
    seeds = [0, 1, 2**32, 2**32 + 1, 2**33, 2**62, 2**63 - 1]
    draws = [_draw(s) for s in seeds]
    for i in range(len(seeds)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j]), (seeds[i], seeds[j])
    assert torch.equal(_draw(2**40 + 7), _draw(2**40 + 7))
    assert seeded_generator(2**40 + 7).initial_seed() == 2**40 + 7
    x = torch.randn(20000, generator=seeded_generator(2**50))
    assert abs(x.mean()) < 0.05 and abs(x.std() - 1) < 0.05


@pytest.mark.parametrize("bad", [-1, 2**63, True, 1.0])
def test_seed_range(bad):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        check_seed(bad)
    if not isinstance(bad, bool | float):
        with pytest.raises(ValueError, match="seed"):
            GenerateRequest(prompt="x", seed=bad)


def test_seed_2_32_gives_other_bytes_than_seed_0():
    a = run_job(ParallelContext.single(), _job())
    b = run_job(ParallelContext.single(), _job(request=GenerateRequest(
        prompt="a cat", num_inference_steps=3, seed=2**32)))
    assert a["video_sha256"] != b["video_sha256"] and a["audio_sha256"] != b["audio_sha256"]


class _NaNAt:
    """Wraps the fake denoiser; from call `step` on, the audio of branch 1 is NaN."""

    def __init__(self, inner, step):
        self.inner, self.step, self.calls = inner, step, 0

    def __call__(self, branches):
        out = self.inner(branches)
        self.calls += 1
        if self.calls > self.step:
            v, a = out[1]
            out[1] = (v, torch.full_like(a, float("nan")))
        return out


def test_nan_velocity_fails_the_run_at_its_step(tmp_path):
    def parts(ctx, job):
        c = fake_components(ctx, job)
        return Components(_NaNAt(c.denoiser, 1), c.text_encoder, c.video_decoder, c.audio_decoder)

    out = tmp_path / "o.mp4"
    with pytest.raises(NonFiniteError, match=r"NaN in the predicted audio velocity of the "
                       r"unconditional branch at denoising step 2/3"):
        run_job(ParallelContext.single(), _job(parts, str(out)))
    assert list(tmp_path.iterdir()) == []


def test_inf_in_decoded_audio_fails_the_run(tmp_path):
    class InfDecoder:
        def __init__(self, inner):
            self.inner = inner
            self.latent_channels, self.sample_rate = inner.latent_channels, inner.sample_rate
            self.channels = inner.channels

        def latent_length(self, d):
            return self.inner.latent_length(d)

        def decode(self, x, n):
            w = self.inner.decode(x, n)
            w[0, 5] = float("inf")
            return w

    def parts(ctx, job):
        c = fake_components(ctx, job)
        return Components(c.denoiser, c.text_encoder, c.video_decoder, InfDecoder(c.audio_decoder))

    with pytest.raises(NonFiniteError, match=r"Inf in the audio waveform after decoding"):
        run_job(ParallelContext.single(), _job(parts, str(tmp_path / "o.mp4")))
    assert list(tmp_path.iterdir()) == []


def test_check_step_is_quiet_on_finite_values():
    big = torch.full((8,), 3e38)  # finite, but its fp32 sum overflows
    check_step(0, 1, [(big, torch.zeros(2)), (torch.zeros(3), torch.zeros(2))])
    with pytest.raises(NonFiniteError, match=r"Inf in the predicted video velocity of the "
                       r"conditional branch at denoising step 1/1 \(sigma 0.5\)"):
        check_step(0, 1, [(torch.tensor([float("-inf")]), torch.zeros(1))], sigma=0.5)


def test_layer_hooks_name_the_first_bad_layer():
    class Poison(nn.Module):
        def forward(self, x):
            return x * float("nan")

    model = nn.Module()
    model.block = nn.Module()
    model.block.layers = nn.ModuleList([nn.Identity(), nn.Identity(), Poison(), nn.Identity()])
    handles = watch_layers(model)
    x = torch.ones(3)
    with pytest.raises(NonFiniteError, match=r"NaN first appears in the output of transformer "
                       r"layer 2"):
        for layer in model.block.layers:
            x = layer(x)
    for h in handles:
        h.remove()
    assert torch.isnan(model.block.layers[2](torch.ones(1))).all()  # hooks removed


def test_truncated_prompt_reported_in_the_sidecar(tmp_path, capsys):
    enc = ByteTextEncoder(4)
    long = "é" * 200  # 400 UTF-8 bytes
    feats = [enc.encode(long), enc.encode("")]
    assert text_report(enc, [long, ""], feats) == {
        "text_tokens": [256, 1], "text_truncated": [True, False], "text_max_tokens": 256}
    out = tmp_path / "o.mp4"
    run_job(ParallelContext.single(), _job(output=str(out), request=GenerateRequest(
        prompt=long, negative_prompt="", num_inference_steps=1)))
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["text_truncated"] == [True, False] and side["text_tokens"] == [256, 1]
    assert side["text_max_tokens"] == 256
    err = capsys.readouterr().err
    assert "warning: --prompt is longer than the text encoder's limit of 256 tokens" in err
