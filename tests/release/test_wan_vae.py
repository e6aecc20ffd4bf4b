"""Wan2.2 VAE (original .pth layout -> diffusers AutoencoderKLWan) against golden/wan22_vae."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from headmoe.pipeline.latents import frame_count
from headmoe.release import video_latents as vl
from headmoe.release import wan_vae as wv
from tests.goldens import golden_dir, released_tensors

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

NAME = "wan22_vae"


def _configs() -> dict:
    return json.loads((golden_dir(NAME) / "config.json").read_text())


@pytest.fixture(scope="module")
def case():
    return load_file(golden_dir(NAME) / "case.safetensors")


@pytest.fixture(scope="module")
def vae():
    path = golden_dir(NAME) / "vae_original_layout.safetensors"
    return wv.load_wan_vae(path, _configs()["AutoencoderKLWan"], dtype=torch.float32)


def test_golden_decode(vae, case):
    dec = wv.WanVideoDecoder(vae)
    out = dec.decode_frames(case["in.latent"])
    ref = case["out.frames"].clamp(-1, 1)  # diffusers clamps inside decode
    assert out.shape == ref.shape == (1, 3, 9, 64, 96)
    assert (out - ref).abs().max().item() <= 1e-4
    pixels = dec.decode(case["in.latent"][0].permute(1, 2, 3, 0), 9)
    diff = (pixels.int() - vl.frames_to_uint8(ref).int()).abs()
    assert pixels.shape == (9, 64, 96, 3) and diff.max().item() <= 1


def test_golden_encoder_half_of_renaming(vae, case):
    mean, std = vl.latent_stats()
    with torch.no_grad():
        mu = vae.encode(case["enc.in.video"]).latent_dist.mode()
    z = (mu - mean.view(1, 48, 1, 1, 1)) / std.view(1, 48, 1, 1, 1)
    assert (z - case["enc.out.latent"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("t", [1, 2])
def test_output_sizes(vae, t):
    dec = wv.WanVideoDecoder(vae)
    z = torch.randn(1, 48, t, 1, 2, generator=torch.Generator().manual_seed(t))
    assert dec.decode_frames(z).shape == (1, 3, frame_count(t), 16, 32)


def _f32(cfg: dict) -> dict:
    """The statistics as float32 values (the golden json holds the float32 literals)."""
    stats = {
        k: torch.tensor(cfg[k], dtype=torch.float32).tolist()
        for k in ("latents_mean", "latents_std")
    }
    return {**cfg, **stats}


def test_released_config_constant():
    cfgs = _configs()
    assert _f32(cfgs["released"]["AutoencoderKLWan"]) == _f32(wv.RELEASED_CONFIG)
    tiny = dict(wv.RELEASED_CONFIG, base_dim=6, decoder_base_dim=8)
    assert _f32(cfgs["AutoencoderKLWan"]) == _f32(tiny)


def test_renamer_maps_released_file_onto_diffusers():
    rows = released_tensors(NAME)
    assert len(rows) == 196
    mapped = {wv.wan_name(r["name"]): r["shape"] for r in rows}
    assert len(mapped) == 196  # 1:1
    model = wv.build_wan_vae()
    assert mapped == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_renamer_rules():
    assert wv.wan_name("conv1.weight") == "quant_conv.weight"
    assert wv.wan_name("conv2.bias") == "post_quant_conv.bias"
    assert wv.wan_name("decoder.conv1.bias") == "decoder.conv_in.bias"
    assert wv.wan_name("decoder.head.0.gamma") == "decoder.norm_out.gamma"
    assert (
        wv.wan_name("encoder.middle.2.residual.3.gamma")
        == "encoder.mid_block.resnets.1.norm2.gamma"
    )
    assert (
        wv.wan_name("decoder.middle.1.to_qkv.weight")
        == "decoder.mid_block.attentions.0.to_qkv.weight"
    )
    assert (
        wv.wan_name("decoder.upsamples.1.upsamples.3.time_conv.weight")
        == "decoder.up_blocks.1.upsampler.time_conv.weight"
    )
    assert (
        wv.wan_name("encoder.downsamples.2.downsamples.0.shortcut.bias")
        == "encoder.down_blocks.2.resnets.0.conv_shortcut.bias"
    )
    for bad in (
        "decoder.head.1.weight",
        "decoder.upsamples.0.upsamples.0.residual.4.weight",
        "vae.x",
    ):
        with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
            wv.wan_name(bad)


def test_pth_folder_and_problems_named(tmp_path):
    cfg = _configs()["AutoencoderKLWan"]
    state = dict(load_file(golden_dir(NAME) / "vae_original_layout.safetensors"))
    torch.save(state, tmp_path / wv.CHECKPOINT_FILE)
    vae = wv.load_wan_vae(tmp_path, cfg, dtype=torch.float32)
    assert torch.equal(vae.state_dict()["decoder.conv_in.weight"], state["decoder.conv1.weight"])
    bad = dict(state)
    bad["decoder.head.2.bias"] = torch.zeros(5)
    bad["decoder.upsamples.0.upsamples.0.residual.2.weight_x"] = bad.pop(
        "decoder.upsamples.0.upsamples.0.residual.2.weight"
    )
    torch.save(bad, tmp_path / wv.CHECKPOINT_FILE)
    with pytest.raises(ValueError) as err:
        wv.load_wan_vae(tmp_path, cfg)
    msg = str(err.value)
    assert "1 missing tensors: decoder.up_blocks.0.resnets.0.conv1.weight" in msg
    assert (
        "decoder.upsamples.0.upsamples.0.residual.2.weight_x (decoder.up_blocks.0.resnets.0.conv1.weight_x)"
        in msg
    )
    assert "decoder.head.2.bias (decoder.conv_out.bias): expected [12], found [5]" in msg
    bad = dict(state, **{"model.ema.x": torch.zeros(1)})
    torch.save(bad, tmp_path / wv.CHECKPOINT_FILE)
    with pytest.raises(ValueError, match="unexpected tensors: model.ema.x"):
        wv.load_wan_vae(tmp_path, cfg)


def test_inverse_renamer_round_trips_released_names():
    for row in released_tensors(NAME):
        assert wv.wan_original_name(wv.wan_name(row["name"])) == row["name"]


def test_config_read_from_file_widths(case, vae):
    path = golden_dir(NAME) / "vae_original_layout.safetensors"
    auto = wv.load_wan_vae(path, dtype=torch.float32)  # no config: widths from the file
    assert auto.config.base_dim == 6 and auto.config.decoder_base_dim == 8
    with torch.no_grad():
        x = vl.denormalize(case["in.latent"])
        assert torch.equal(auto.decode(x).sample, vae.decode(x).sample)


def test_tiny_release_folder(tmp_path):
    wv.build_tiny_wan_vae(tmp_path / "a")
    wv.build_tiny_wan_vae(tmp_path / "b")
    name = wv.CHECKPOINT_FILE
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    dec = wv.WanVideoDecoder(wv.load_wan_vae(tmp_path / "a", dtype=torch.float32))
    latents = torch.randn(2, 1, 2, 48, generator=torch.Generator().manual_seed(0))
    pixels = dec.decode(latents, 5)
    assert pixels.shape == (5, 16, 32, 3) and pixels.float().std().item() > 5
