"""A deterministic test-only denoiser (no transformer) for pipeline-logic tests.

The velocity is an elementwise function of the latents, the noise level and the mean of the
branch's text features, so cond and uncond differ and every rank computes the same bits."""

import torch

from headmoe.pipeline.job import Components
from headmoe.release.standins import ByteTextEncoder, TinyAudioDecoder, TinyVideoDecoder

VIDEO_C, AUDIO_C, TEXT_C = 4, 3, 8


def fake_velocity(x, text, t):
    return torch.tanh(x) * (1.0 + text.mean()) - 0.5 * t * x


class FakeDenoiser:
    def __init__(self):
        self.calls = []  # number of branches per call

    def __call__(self, branches):
        self.calls.append(len(branches))
        return [
            (fake_velocity(b.video, b.text, b.t_video), fake_velocity(b.audio, b.text, b.t_audio))
            for b in branches
        ]


def fake_components(ctx, job):
    return Components(
        FakeDenoiser(),
        ByteTextEncoder(TEXT_C),
        TinyVideoDecoder(VIDEO_C),
        TinyAudioDecoder(AUDIO_C),
    )
