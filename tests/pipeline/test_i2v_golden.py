"""Image-to-video against golden/magi2_pipeline (MAGI2.md section 9): the Wan2.2 encoder's
latent (d), the figure marker and the pooled `<Figure 1>` embedding (c), and the I2V packing
and transformer predictions of ``denoise_i2v`` (b)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.models.magi2 import BranchInput, Magi2Transformer, load_checkpoint, pack_branches
from headmoe.pipeline import i2v as figure
from headmoe.pipeline import wan_vae as wv
from tests.models.golden import golden_config, golden_weights
from tests.pipeline.goldens import golden_file

NAME = "magi2_pipeline"
#: MAGI2 pipeline README tolerances
LATENT_TOL, PRED_TOL = 1e-4, 2e-5


def _json(rel: str) -> dict:
    return json.loads(golden_file(NAME, rel).read_text())


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # how the golden data was made
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------- (d) the encoder
def test_golden_image_latent(single_thread):
    """The tiny Wan2.2 VAE of golden/wan22_vae (which holds the encoder half too) in the
    release's .pth layout: `load_wan_encoder` + `WanImageEncoder` on the golden VAE input."""
    gold = load_file(golden_file(NAME, "image_preprocess.safetensors"))
    encoder = wv.WanImageEncoder(wv.load_wan_encoder(
        golden_file("wan22_vae", "vae_original_layout.safetensors")))
    assert not hasattr(encoder.vae, "decoder")  # the decoder half is never materialised
    cases = _json("cases.json")["images"]
    assert len(cases) == 4
    for key in cases:
        z = encoder.encode(gold[f"{key}.pixels"])
        ref = gold[f"{key}.latent"][:, 0]  # [1, 1, 48, 1, h, w] -> [1, 48, 1, h, w]
        assert z.shape == ref.shape
        assert (z - ref).abs().max().item() <= LATENT_TOL, key


# ---------------------------------------------------------------------- (c) the marker
def test_ensure_figure_token_follows_sandai():
    cases = _json("prompts.json")["ensure_figure_token"]
    assert len(cases) == 6
    for name, case in cases.items():
        assert figure.ensure_figure_token(case["input"]) == case["sandai_output"], name


def test_figure_token_indices_from_golden_offsets():
    case = _json("tokenization.json")["prompts"]["figure_marker"]
    offsets = case["split"]["offsets"]
    got = figure.figure_token_indices(case["normalized"], offsets)
    n = len(offsets)
    assert got == list(range(n - 7, n))  # "<", "F", "i", "gure", " ", "1", ">"
    assert [case["split"]["tokens"][i] for i in got] == ["<", "F", "i", "gure", "Ġ", "1", ">"]
    assert figure.figure_token_indices("no marker here", offsets) == []
    # (0, 0) spans after the first token never count
    assert figure.figure_token_indices("<Figure 1>", [(0, 3), (0, 0), (3, 10)]) == [0, 2]


@pytest.mark.parametrize("case", ["plain", "json_dict"])
def test_pool_figure_token_bitwise(case):
    meta = _json("tokenization.json")["pool_figure_tokens"][case]
    gold = load_file(golden_file(NAME, "pool_figure_tokens.safetensors"))
    feats = gold[f"pool.{case}.features"][0]
    pooled = figure.pool_figure_token(feats, meta["indices"]["<Figure 1>"])
    assert torch.equal(pooled, gold[f"pool.{case}.pooled"][0])
    assert torch.equal(pooled, gold[f"pool.{case}.special_token"][0, 0])
    absent = figure.pool_figure_token(feats, [])  # "<Figure 2>": zeros
    assert torch.equal(absent, gold[f"pool.{case}.pooled"][1])


# ---------------------------------------------------------------------- (b) packing
def i2v_branches(d: dict[str, torch.Tensor], tau: float) -> list[BranchInput]:
    """The golden I2V inputs as headmoe branches (cond, uncond): both carry the same image
    latent `[h, w, 48]` and the same special token (`use_ref_for_uncond`)."""
    image = d["in.ref_image_feat"][0, 0, :, 0].permute(1, 2, 0).contiguous()
    token = d["in.ref_image_special_token"][0, 0]
    video = d["in.video_noise"][0].permute(1, 2, 3, 0).contiguous()
    audio = d["in.audio_noise"][0]
    return [BranchInput(video, audio, d[f"in.{k}"][0], tau, tau, image, token)
            for k in ("txt_feat", "null_txt_feat")]


@pytest.fixture(scope="module")
def i2v():
    return load_file(golden_file(NAME, "denoise_i2v.safetensors"))


def test_step0_packed_bitwise(i2v):
    tau = float(i2v["step0.model_t"][0])
    packed = pack_branches(i2v_branches(i2v, tau), golden_config())
    for key in ("x", "coords", "modality", "cu_seqlens", "time_tokens"):
        gold = i2v[f"step0.packed.{key}"]
        assert torch.equal(getattr(packed, key).to(gold.dtype), gold), key
    end = int(packed.cu_seqlens[1])  # 1 special token + 3 x 5 image rows close both branches
    assert torch.equal(packed.x[end - 16 : end], packed.x[-16:])


def test_step0_predictions(i2v, single_thread):
    model = Magi2Transformer(golden_config(), ParallelContext.single(ParallelConfig()),
                             dtype=torch.float32)
    load_checkpoint(model, str(golden_weights()))
    outs = model.eval()(i2v_branches(i2v, float(i2v["step0.model_t"][0])))
    video = torch.stack([o.video.permute(3, 0, 1, 2) for o in outs])
    audio = torch.stack([o.audio for o in outs])
    assert (video - i2v["step0.pred.video"]).abs().max().item() <= PRED_TOL
    assert (audio - i2v["step0.pred.audio"]).abs().max().item() <= PRED_TOL


def test_image_rows_validated():
    cfg = golden_config()
    v, a, t = torch.zeros(1, 1, 1, 48), torch.zeros(1, 64), torch.zeros(2, 40)
    with pytest.raises(ValueError, match=r"branches\[0\].image / image_token"):
        pack_branches([BranchInput(v, a, t, 0.5, 0.5, torch.zeros(2, 2, 48), None)], cfg)
    with pytest.raises(ValueError, match=r"branches\[0\].image / image_token"):
        pack_branches([BranchInput(v, a, t, 0.5, 0.5, torch.zeros(2, 2, 47),
                                   torch.zeros(40))], cfg)
