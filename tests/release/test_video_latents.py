"""Wan2.2 latent statistics, de-normalisation and pixel conversion (the latent sizes:
tests/pipeline/test_latents.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from headmoe.release import video_latents as vl
from tests.goldens import golden_dir

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden


@pytest.mark.parametrize("where", ["turbo_vae/case_short", "wan22_vae/case"])
def test_stats_equal_golden_bitwise(where):
    folder, case = where.split("/")
    c = load_file(golden_dir(folder) / f"{case}.safetensors")
    mean, std = vl.latent_stats()
    assert torch.equal(mean, c["in.latent_mean"]) and torch.equal(std, c["in.latent_std"])


def test_denormalize():
    z = torch.randn(2, 48, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    mean, std = vl.latent_stats()
    ref = z * std.view(1, 48, 1, 1, 1) + mean.view(1, 48, 1, 1, 1)
    out = vl.denormalize(z)
    assert out.dtype == z.dtype and (out - ref).abs().max().item() <= 1e-6
    last = vl.denormalize(z.permute(0, 2, 3, 4, 1), channel_dim=-1)
    assert torch.equal(last, out.permute(0, 2, 3, 4, 1))
    assert vl.denormalize(z.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="47 channels"):
        vl.denormalize(z[:, :47])


def test_frames_to_uint8_truncates_and_clamps():
    values = torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0, 3.0, 0.5])
    frames = values.view(1, 1, 1, 1, 7).expand(2, 3, 1, 1, 7).contiguous()
    out = vl.frames_to_uint8(frames)
    assert out.shape == (1, 1, 7, 3) and out.dtype == torch.uint8
    # 0.999 -> 0.9995 * 255 = 254.87 -> 254 (truncated); 0 -> 127.5 -> 127; 0.5 -> 191.25
    assert out[0, 0, :, 0].tolist() == [0, 0, 127, 254, 255, 255, 191]

