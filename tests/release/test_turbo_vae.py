"""TurboV3 decoder against golden/turbo_vae (reference: SandAI's TurboVAED)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from headmoe.pipeline.latents import frame_count
from headmoe.release import turbo_vae as tv
from headmoe.release import video_latents as vl
from tests.goldens import golden_dir, released_tensors

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

NAME = "turbo_vae"


@pytest.fixture(scope="module")
def tiny_model() -> tv.TurboV3:
    g = golden_dir(NAME)
    cfg = tv.TurboVAEConfig.from_json(g / "config.json")
    return tv.load_turbo_vae(g / "model.safetensors", cfg, dtype=torch.float32)


@pytest.mark.parametrize("case", ["case_short", "case_windows"])
def test_golden_cases(tiny_model, case):
    c = load_file(golden_dir(NAME) / f"{case}.safetensors")
    trace: dict[str, torch.Tensor] = {}
    out = tiny_model.decode(c["in.latent"], trace)
    assert out.shape == c["out.frames"].shape
    assert (out - c["out.frames"]).abs().max().item() <= 1e-4
    pixels = vl.frames_to_uint8(out)
    assert pixels.dtype == torch.uint8 and pixels.shape == c["out.uint8"].shape
    diff = (pixels.int() - c["out.uint8"].int()).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() <= 1e-3
    traced = [k for k in c if k.startswith("trace.")]
    assert "trace.windows" in traced and "trace.latent_denorm_padded" in traced
    for key in traced:
        ours = trace[key.removeprefix("trace.")]
        assert ours.shape == c[key].shape, key
        if ours.dtype == torch.int64:
            assert torch.equal(ours, c[key]), key
        else:
            assert (ours - c[key]).abs().max().item() <= 1e-4, key


def test_window_tables_as_readme():
    assert tv.window_table(7) == [(0, 7, 1, 0, 0)]
    assert tv.window_table(21) == [(0, 8, 1, 0, 4), (6, 15, 0, 4, 4), (13, 21, 0, 4, 0)]
    with pytest.raises(ValueError, match="padded latent length 9"):
        tv.window_table(9)


@pytest.mark.parametrize("n", range(1, 23))
def test_window_arithmetic_gives_4n_minus_3_frames(n):
    pad = tv.pad_count(n)
    kept = 0
    for left, right, first, trim_l, trim_r in tv.window_table(n + pad):
        kept += 4 * (right - left) - (3 if first else 0) - trim_l - trim_r
    assert kept - 4 * pad == frame_count(n) == 4 * n - 3


@pytest.mark.parametrize("n", [1, 2, 8, 15])
def test_decode_sizes(tiny_model, n):
    out = tiny_model.decode(torch.randn(1, 48, n, 1, 2, generator=torch.Generator().manual_seed(n)))
    assert out.shape == (1, 3, 4 * (n - 1) + 1, 16, 32)


def test_released_config_lists_exactly_the_released_tensors():
    rows = released_tensors(NAME)
    model = tv.build_turbo_vae(tv.TurboVAEConfig())
    ours = [(f"module.{k}", tuple(v.shape)) for k, v in model.state_dict().items()]
    assert ours == [(r["name"], r["shape"]) for r in rows]
    assert len(ours) == 80
    assert sum(math.prod(s) for _, s in ours) == 107_122_892
    assert all(v.device.type == "meta" for v in model.state_dict().values())


def test_tiny_config_is_released_but_widths():
    data = json.loads((golden_dir(NAME) / "config.json").read_text())
    cfg = tv.TurboVAEConfig.from_dict(data)
    released = tv.TurboVAEConfig()
    assert cfg.decoder_block_out_channels == (8, 16, 24, 32)
    assert cfg == tv.TurboVAEConfig(
        **{**released.__dict__, "decoder_block_out_channels": (8, 16, 24, 32)}
    )
    assert tv.TurboVAEConfig.from_dict({**data, "bogus": 1}) == cfg  # ignored, as the reference
    assert tv.TurboVAEConfig.unused_keys({**data, "bogus": 1}) == ["bogus"]
    with pytest.raises(ValueError, match="decoder_causal"):
        tv.TurboVAEConfig.from_dict({**data, "decoder_causal": True})


def _release_folder(tmp_path, state, extra=None):
    g = golden_dir(NAME)
    data = json.loads((g / "config.json").read_text())
    data.update({"aligned_feature_projection_mode": "conv-2layer", "aligned_blks_indices": [0, 1]})
    (tmp_path / tv.CONFIG_FILE).write_text(json.dumps(data))
    torch.save({"ema_state_dict": state, **(extra or {})}, tmp_path / tv.CHECKPOINT_FILE)
    return tmp_path


def test_checkpoint_folder_layout_loads(tmp_path, tiny_model):
    state = dict(load_file(golden_dir(NAME) / "model.safetensors"))
    heads = {
        f"module.aligned_feature_projection_heads.{a}.{b}.conv.{w}": torch.zeros(2)
        for a in (0, 1)
        for b in (0, 1)
        for w in ("weight", "bias")
    }
    folder = _release_folder(tmp_path, {**state, **heads}, {"step": torch.tensor(3)})
    model = tv.load_turbo_vae(folder, dtype=torch.bfloat16)
    # training-only state is not used (as by the reference) and reported, not refused
    assert tv.unused_entries(folder) == [
        f"{tv.CONFIG_FILE}: aligned_blks_indices, aligned_feature_projection_mode",
        f"{tv.CHECKPOINT_FILE}: step, " + ", ".join(heads)]
    assert next(model.parameters()).dtype == torch.bfloat16
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.to(torch.bfloat16)), k


def test_checkpoint_problems_named(tmp_path):
    state = dict(load_file(golden_dir(NAME) / "model.safetensors"))
    bad = dict(state)
    bad["module.decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="module.decoder.extra.weight"):
        tv.load_turbo_vae(_release_folder(tmp_path, bad))
    bad = dict(state)
    bad["module.encoder.conv.weight"] = torch.zeros(1)  # not the decoder's: not used
    tv.load_turbo_vae(_release_folder(tmp_path, bad))
    assert tv.unused_entries(tmp_path)[-1] == f"{tv.CHECKPOINT_FILE}: module.encoder.conv.weight"
    bad = dict(state)
    del bad["module.decoder.conv_out.conv.bias"]
    bad["module.decoder.conv_in.conv.bias"] = torch.zeros(5)
    with pytest.raises(ValueError) as err:
        tv.load_turbo_vae(_release_folder(tmp_path, bad))
    msg = str(err.value)
    assert "1 missing tensors: module.decoder.conv_out.conv.bias" in msg
    assert "module.decoder.conv_in.conv.bias: expected [32], found [5]" in msg


def test_pipeline_adapter(tiny_model):
    c = load_file(golden_dir(NAME) / "case_short.safetensors")
    dec = tv.TurboVideoDecoder(tiny_model)
    latents = c["in.latent"][0].permute(1, 2, 3, 0)  # [T, H, W, C]
    assert dec.latent_shape(9, 64, 96) == tuple(latents.shape[:3])
    pixels = dec.decode(latents, 9)
    diff = (pixels.int() - c["out.uint8"].int()).abs()
    assert diff.max().item() <= 1
    assert dec.decode(latents, 6).shape == (6, 64, 96, 3)


def test_tiny_release_folder(tmp_path):
    a = tv.build_tiny_turbo_vae(tmp_path / "a")
    b = tv.build_tiny_turbo_vae(tmp_path / "b")
    for name in (tv.CONFIG_FILE, tv.CHECKPOINT_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    dec = tv.TurboVideoDecoder.from_folder(a, dtype=torch.float32)
    assert dec.model.config.decoder_block_out_channels == (8, 16, 24, 32)
    latents = torch.randn(4, 4, 6, 48, generator=torch.Generator().manual_seed(0))
    pixels = dec.decode(latents, 13)
    assert pixels.shape == (13, 64, 96, 3) and pixels.dtype == torch.uint8
    assert torch.equal(
        pixels, tv.TurboVideoDecoder.from_folder(b, dtype=torch.float32).decode(latents, 13)
    )
    assert pixels.float().std().item() > 20  # not a constant picture
