"""Stable-Audio-Open VAE decoder (diffusers Oobleck) against golden/stable_audio_vae."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from headmoe.release import audio_vae as av
from tests.goldens import golden_dir, released_tensors

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

NAME = "stable_audio_vae"


@pytest.fixture(scope="module")
def case() -> dict[str, torch.Tensor]:
    return load_file(golden_dir(NAME) / "case.safetensors")


@pytest.fixture(scope="module")
def tiny() -> av.OobleckAudioDecoder:
    return av.load_oobleck_decoder(golden_dir(NAME))


@pytest.mark.parametrize("fold", [True, False])
def test_golden_case(case, fold):
    dec = av.load_oobleck_decoder(golden_dir(NAME), fold_weight_norm=fold)
    latents = case["in.latent"][0].T  # [T, 64], as the sampler hands it over
    wave = dec.decode_51200(latents)
    assert wave.shape == (2, 51200)
    assert (wave - case["out.audio_51200"][0]).abs().max().item() <= 1e-4
    out = av.resample_51200_to_44100(wave)
    assert out.shape == (2, 44100)
    assert (out.T - case["out.audio_44100"]).abs().max().item() <= 1e-4


def test_resampling_alone_matches_reference(case):
    out = av.resample_51200_to_44100(case["out.audio_51200"][0])
    assert (out.T - case["out.audio_44100"]).abs().max().item() <= 1e-5


def test_fft_resample_keeps_band_limited_sines():
    n, m = 512 * 4, 441 * 4
    t_in = torch.arange(n, dtype=torch.float64) / n
    t_out = torch.arange(m, dtype=torch.float64) / m
    x = torch.stack([torch.sin(2 * math.pi * 7 * t_in), torch.cos(2 * math.pi * 300 * t_in)])
    ref = torch.stack([torch.sin(2 * math.pi * 7 * t_out), torch.cos(2 * math.pi * 300 * t_out)])
    y = av.fft_resample(x, m)
    assert y.shape == (2, m) and (y - ref).abs().max().item() <= 1e-9
    with pytest.raises(ValueError, match="downsampling only"):
        av.fft_resample(x, n + 1)


@pytest.mark.parametrize("t", [1, 3])
def test_output_sizes(tiny, t):
    latents = torch.randn(t, 64, generator=torch.Generator().manual_seed(t))
    assert tiny.decode_51200(latents).shape == (2, 2048 * t)
    out = tiny.decode(latents, 1764 * t)
    assert out.shape == (2, 1764 * t) and out.abs().max().item() <= 1.0
    assert tiny.decode(latents, 100).shape == (2, 100)
    with pytest.raises(ValueError, match="num_samples"):
        tiny.decode(latents, 1764 * t + 1)
    assert tiny.latent_length(10.0) == 250 and tiny.latent_length(0.01) == 1
    assert (tiny.sample_rate, tiny.channels, tiny.latent_channels) == (44100, 2, 64)


def test_renamer_covers_released_file():
    from diffusers import AutoencoderOobleck

    rows = released_tensors(NAME)
    with torch.device("meta"), pytest.warns(FutureWarning):
        model = AutoencoderOobleck()  # diffusers' defaults are the released VAE
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mapped, skipped = {}, []
    for row in rows:
        name = av.oobleck_name(row["name"])
        if name is None:
            skipped.append(row["part"])
            continue
        shape = av.oobleck_tensor(name, torch.empty(row["shape"], device="meta")).shape
        assert name not in mapped, name
        mapped[name] = tuple(shape)
    assert mapped == expected
    assert len(mapped) == 365 and sorted(set(skipped)) == ["conditioner", "diffusion"]
    assert len(skipped) == 374 + 6


def test_renamer_rules():
    assert (
        av.oobleck_name("pretransform.model.decoder.layers.0.weight_v") == "decoder.conv1.weight_v"
    )
    assert (
        av.oobleck_name("pretransform.model.decoder.layers.3.layers.4.layers.2.alpha")
        == "decoder.block.2.res_unit3.snake2.alpha"
    )
    assert (
        av.oobleck_name("pretransform.model.decoder.layers.7.weight_g") == "decoder.conv2.weight_g"
    )
    assert (
        av.oobleck_name("pretransform.model.encoder.layers.2.layers.4.bias")
        == "encoder.block.1.conv1.bias"
    )
    for bad in ("pretransform.model.decoder.layers.9.bias", "foo.bar"):
        with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
            av.oobleck_name(bad)


def _edited_folder(tmp_path, edit):
    g = golden_dir(NAME)
    shutil.copy(g / av.CONFIG_FILE, tmp_path / av.CONFIG_FILE)
    state = dict(load_file(g / av.WEIGHTS_FILE))
    edit(state)
    save_file(state, tmp_path / av.WEIGHTS_FILE)
    return tmp_path


def test_problems_named(tmp_path):
    old = "pretransform.model.decoder.layers.2.layers.1.bias"

    def rename(s):
        s["pretransform.model.decoder.layers.2.layers.1.biass"] = s.pop(old)
        s[old.replace("layers.2.layers.1", "layers.1.layers.1")] = torch.zeros(3)

    with pytest.raises(ValueError) as err:
        av.load_oobleck_decoder(_edited_folder(tmp_path, rename))
    msg = str(err.value)
    assert "1 missing tensors: block.1.conv_t1.bias;" in msg  # diffusers spelling
    assert (
        "pretransform.model.decoder.layers.1.layers.1.bias (block.0.conv_t1.bias): expected [64], found [3]"
        in msg
    )
    assert "layers.2.layers.1.biass (block.1.conv_t1.biass)" in msg  # unexpected


def test_missing_files_named(tmp_path):
    with pytest.raises(ValueError, match="missing model_config.json"):
        av.load_oobleck_decoder(tmp_path)


def test_inverse_renamer_round_trips_released_decoder():
    rows = [r for r in released_tensors(NAME) if r["part"] == "decoder"]
    assert len(rows) == 182
    for r in rows:
        name = av.oobleck_name(r["name"]).removeprefix("decoder.")
        assert av.stable_audio_name(name) == r["name"]


def test_tiny_release_folder(tmp_path):
    a = av.build_tiny_audio_vae(tmp_path / "a")
    av.build_tiny_audio_vae(tmp_path / "b")
    for name in (av.CONFIG_FILE, av.WEIGHTS_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    dec = av.load_oobleck_decoder(a)
    assert dec.config == av.OobleckConfig(channels=8)
    latents = torch.randn(26, 64, generator=torch.Generator().manual_seed(0))
    wave = dec.decode(latents, 45864)
    assert wave.shape == (2, 45864) and 0.01 < wave.std().item() < 1.0
