"""Image-to-video against golden/magi2_pipeline (MAGI2.md section 9): the Wan2.2 encoder's
latent (d), the figure marker and the pooled `<Figure 1>` embedding (c), and the I2V packing
and transformer predictions of ``denoise_i2v`` (b)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from headmoe.distributed.context import ParallelContext
from headmoe.models.magi2 import BranchInput, Magi2Transformer, load_checkpoint, pack_branches
from headmoe.pipeline import i2v as figure
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.interfaces import Components
from headmoe.pipeline.job import GenerateJob, denoise, draw_noise
from headmoe.pipeline.request import GenerateRequest
from headmoe.release import wan_vae as wv
from headmoe.release.components import Magi2Denoiser
from tests.models.golden import golden_config, golden_weights, max_abs
from tests.pipeline.goldens import golden_file
from tests.pipeline.released_loop import TIME_TOKENS_TOL, Recorder, check_loop, video

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

NAME = "magi2_pipeline"
#: MAGI2 pipeline README tolerance (d); (b)'s are `released_loop`'s
LATENT_TOL = 1e-4


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
def test_figure_indices_through_the_release_tokenizer(case):
    """`Qwen35TextEncoder.figure_indices` with the golden tiny tokenizer set up as the release
    sets it up (the extra pre-tokenizer split) and the marker added by `ensure_figure_token`."""
    from transformers import AutoTokenizer

    from headmoe.pipeline.prompts import add_released_split
    from headmoe.release.text_encoder import Qwen35TextEncoder

    meta = _json("tokenization.json")["pool_figure_tokens"][case]
    tok = AutoTokenizer.from_pretrained(golden_file(NAME, "tokenizer/tokenizer.json").parent,
                                        local_files_only=True, padding_side="right")
    add_released_split(tok)
    enc = Qwen35TextEncoder(SimpleNamespace(config=SimpleNamespace(hidden_size=40)), tok, 5)
    for prompt in (meta["prompt"], figure.ensure_figure_token(meta["prompt_before_ensure"])):
        idx = enc.figure_indices(prompt)
        assert len(idx) == 7
        if prompt == meta["prompt"]:
            assert idx == meta["indices"]["<Figure 1>"]
    assert len(enc.tokenize(meta["prompt"])[0]) == meta["num_tokens"]


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


# ---------------------------------------------------------------------- (b) the loop
STEPS = 3


@pytest.fixture(scope="module")
def i2v_run(single_thread):
    """``denoise_i2v`` through headmoe's `draw_noise`, `denoise` (released sampler), packing
    and transformer, with the golden image latent and special token as the `ImageCondition`
    of both branches: (golden tensors, recorded calls, final latents, noise)."""
    d = load_file(golden_file(NAME, "denoise_i2v.safetensors"))
    seed = _json("cases.json")["denoise"]["i2v"]["make_denoise_inputs"]["seed"]
    model = Magi2Transformer(golden_config(), dtype=torch.float32)
    load_checkpoint(model, golden_weights())
    rec = Recorder(Magi2Denoiser(model.eval()))
    req = GenerateRequest(prompt="golden", num_inference_steps=STEPS, shift=7.0, seed=seed,
                          guidance_scale=5.0, audio_guidance_scale=7.0)
    _, _, t, h, w = d["in.video_noise"].shape
    parts = Components(rec, None, _Shapes((t, h, w), 48), _Shapes(d["in.audio_noise"].shape[1], 64))
    noise = draw_noise(ParallelContext.single(), req, parts)
    cond = figure.ImageCondition(video(d["in.ref_image_feat"][0, 0])[0],
                                 d["in.ref_image_special_token"][0, 0])
    job = GenerateJob(deployment=Deployment(model_config=None, parallel=None), request=req,
                      output=None, progress=False)
    texts = [d["in.txt_feat"][0], d["in.null_txt_feat"][0]]
    xv, xa, _ = denoise(ParallelContext.single(), job, parts, noise, texts, cond=cond)
    return d, rec.calls, (xv, xa), noise


class _Shapes:
    """A decoder that only states the golden latent size (for `draw_noise`)."""

    def __init__(self, size, channels):
        self.size, self.latent_channels, self.sample_rate = size, channels, 44100

    def latent_shape(self, num_frames, height, width):
        return self.size

    def latent_length(self, duration_s):
        return self.size


def test_i2v_noise_and_step0_packed_bitwise(i2v_run):
    d, calls, _, noise = i2v_run
    assert torch.equal(noise.video, video(d["in.video_noise"][0]))
    assert torch.equal(noise.audio, d["in.audio_noise"][0])
    packed = pack_branches(calls[0][0], golden_config())
    for key in ("x", "coords", "modality", "cu_seqlens"):
        gold = d[f"step0.packed.{key}"]
        assert torch.equal(getattr(packed, key), gold.to(getattr(packed, key).dtype)), key
    assert max_abs(packed.time_tokens, d["step0.packed.time_tokens"]) <= TIME_TOKENS_TOL
    end = int(packed.cu_seqlens[1])  # 1 special token + 3 x 5 image rows close both branches
    assert torch.equal(packed.x[end - 16 : end], packed.x[-16:])


def test_i2v_predictions_guidance_and_latents(i2v_run):
    d, calls, final, _ = i2v_run
    check_loop(d, calls, final, STEPS)


def test_image_rows_validated():
    cfg = golden_config()
    v, a, t = torch.zeros(1, 1, 1, 48), torch.zeros(1, 64), torch.zeros(2, 40)
    with pytest.raises(ValueError, match=r"branches\[0\].image / image_token"):
        pack_branches([BranchInput(v, a, t, 0.5, 0.5, torch.zeros(2, 2, 48), None)], cfg)
    with pytest.raises(ValueError, match=r"branches\[0\].image / image_token"):
        pack_branches([BranchInput(v, a, t, 0.5, 0.5, torch.zeros(2, 2, 47),
                                   torch.zeros(40))], cfg)
