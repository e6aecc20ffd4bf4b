"""Image-to-video through the pipeline on the embedded tiny release: the image rows reach both
CFG branches, the encoder runs on rank 0 and its latent reaches every rank, bad images and
models without an encoder are refused before any rank starts, and 1 and 4 ranks (SP4, EP2)
write the same bytes (issue 18)."""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import headmoe.cli.generate as generate_cli
from headmoe.cli.main import main
from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.pipeline import i2v
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.image import prepare_image
from headmoe.pipeline.job import GenerateJob, build_components, run_request
from headmoe.pipeline.request import GenerateRequest
from headmoe.release import folder as release
from headmoe.release import placement
from headmoe.release.components import magi2_components
from tests.pipeline.goldens import golden_file
from tests.release.test_release import _generate as release_generate

PROMPT = "a red fox running through snow at dusk"
REQUEST = ["--height", "64", "--width", "96", "--num-frames", "5", "--num-inference-steps", "2",
           "--prompt", PROMPT, "--no-progress"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_release_in) -> Path:
    return tiny_release_in(tmp_path_factory.mktemp("cache"))


def _image_path(name: str = "landscape_37x23") -> Path:
    return golden_file("magi2_pipeline", f"images/{name}.png")


def _image(height: int = 64, width: int = 96):
    return prepare_image(_image_path().read_bytes(), height, width)


def _job(folder: Path, image) -> GenerateJob:
    rel = release.find_release(folder, image_encoder=True)
    req = GenerateRequest(prompt=PROMPT, height=64, width=96, num_frames=5,
                          num_inference_steps=2)
    dep = Deployment(model_config=rel.model_config, checkpoint=rel.transformer, release=rel)
    return GenerateJob(deployment=dep, request=req, output=None, progress=False, image=image,
                       components=magi2_components)


def test_image_rows_reach_both_branches(folder):
    job = _job(folder, _image())
    parts = build_components(ParallelContext.single(), job)
    seen = []
    inner = parts.denoiser
    parts.denoiser = lambda branches: seen.append(branches) or inner(branches)
    i2v_hashes = run_request(ParallelContext.single(), job, parts)
    assert len(seen) == 2 and all(len(b) == 2 for b in seen)  # 2 steps, CFG1
    cond, uncond = seen[0]
    latent = parts.image_encoder.encode(job.image)
    assert latent.shape == (2, 6, 48)  # 37 x 23 at a long side of 96 -> 96 x 32 pixels
    for br in (cond, uncond):
        assert torch.equal(br.image, latent) and torch.equal(br.image_token, cond.image_token)
    prompt = i2v.ensure_figure_token(PROMPT)
    indices = parts.text_encoder.figure_indices(prompt)
    tokens = parts.text_encoder.encoder.tokenizer(prompt, return_offsets_mapping=True)
    spans = [tokens["offset_mapping"][i] for i in indices]
    assert prompt[spans[0][0]:spans[-1][1]].strip() == i2v.FIGURE_TOKEN
    feats = parts.text_encoder.encode(prompt)
    assert torch.equal(cond.image_token, i2v.pool_figure_token(feats, indices))
    t2v = run_request(ParallelContext.single(), dataclasses.replace(job, image=None), parts)
    assert t2v["video_sha256"] != i2v_hashes["video_sha256"]
    assert seen[-1][0].image is None and seen[-1][1].image_token is None


def test_offload_and_missing_encoder(folder):
    rel = release.find_release(folder)  # image_encoder=False: not loaded
    assert rel.image_encoder is None
    assert release.find_release(folder, image_encoder=None).image_encoder == str(folder / "vae")
    job = _job(folder, _image())
    job = dataclasses.replace(job, deployment=dataclasses.replace(job.deployment, release=rel))
    parts = build_components(ParallelContext.single(), job)
    assert parts.image_encoder is None
    with pytest.raises(ValueError, match="no image encoder"):
        run_request(ParallelContext.single(), job, parts)


def _broadcast_body(rank, world_size, folder, image):
    ctx = ParallelContext.initialize(ParallelConfig(ulysses_degree=2),
                                     timeout=timedelta(seconds=60))
    try:
        rel = release.find_release(folder, image_encoder=True)
        enc = placement.world_image_encoder(ctx, rel)
        if rank != placement.IMAGE_RANK:
            image = dataclasses.replace(image, pixels=None)  # as a serve rank holds it
        out = {"loaded": enc.encoder is not None, "latent": enc.encode(image).tolist()}
        if enc.encoder is not None:
            enc.encoder.encode = lambda pixels: 1 / 0
        try:
            enc.encode(image)
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        ctx.destroy()


@pytest.mark.multirank
def test_latent_reaches_every_rank(folder):
    from headmoe.release import wan_vae
    from headmoe.testing import run_ranks

    image = _image()
    per_rank = run_ranks(_broadcast_body, 2, args=(str(folder), image), timeout=240)
    enc = wan_vae.WanImageEncoder(wan_vae.load_wan_encoder(folder / "vae"))
    threads = torch.get_num_threads()
    torch.set_num_threads(placement.CPU_THREADS)
    try:
        want = enc.encode(image.vae_input())[0, :, 0].permute(1, 2, 0)
    finally:
        torch.set_num_threads(threads)
    assert [r["loaded"] for r in per_rank] == [True, False]
    for r in per_rank:
        assert torch.equal(torch.tensor(r["latent"]), want)  # float32 -> float -> exact
    assert per_rank[0]["error"].startswith("ZeroDivisionError")
    assert per_rank[1]["error"] == "RuntimeError: the image encoder failed on rank 0 (see its error)"


def _refused(cache, tmp_path, capsys, monkeypatch, *flags: str) -> str:
    launched = []
    monkeypatch.setattr(generate_cli, "launch_local", lambda *a, **k: launched.append(a))
    out = tmp_path / "o.mp4"
    code = main(["generate", "--nproc", "2", "--ulysses-degree", "2", "--output", str(out),
                 "--cache-dir", str(cache), *REQUEST, *flags])
    err = capsys.readouterr().err
    assert code == 2 and not launched and not out.exists(), err
    assert err.startswith("headmoe: error: ") and err.count("\n") == 1, err
    return err


def test_bad_images_refused_before_any_rank(folder, tmp_path, capsys, monkeypatch):
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    # the embedded release by name (a folder path would add a note about its unused entries)
    err = _refused(folder.parent, tmp_path, capsys, monkeypatch, "--model", "tiny", "--image",
                   str(text))
    assert f"--image {str(text)!r} is not an image" in err
    err = _refused(folder.parent, tmp_path, capsys, monkeypatch, "--model", "tiny", "--image",
                   str(tmp_path / "nope.png"))
    assert "cannot be read" in err
    ckpt = next((folder / "preview").glob("*.index.json"))
    err = _refused(folder.parent, tmp_path, capsys, monkeypatch, "--model", str(ckpt), "--image",
                   str(_image_path()))
    assert "--image needs a release folder with vae/" in err


def test_animated_image_names_the_frame_used(folder, tmp_path, capsys):
    """generate's checks (no rank starts in `build_job`) say which frame is used."""
    import argparse

    from PIL import Image

    frames = [Image.new("RGB", (40, 24), c) for c in ((255, 0, 0), (0, 0, 255))]
    path = tmp_path / "anim.png"
    frames[0].save(path, "PNG", save_all=True, append_images=frames[1:])
    parser = argparse.ArgumentParser()
    generate_cli.register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", str(folder), "--image", str(path),
                              "--output", str(tmp_path / "a.mp4"), *REQUEST])
    job, _ = generate_cli.build_job(args)
    assert job.image.frames == 2 and job.image.pixels_uint8()[0, 0].tolist() == [255, 0, 0]
    assert "is animated (2 frames); its first frame is used" in capsys.readouterr().err


def _generate(folder: Path, out: Path, nproc: int, *flags: str) -> dict:
    """`test_release._generate` (a subprocess run) of `REQUEST` with the image."""
    return release_generate(folder, out, nproc, "--image", str(_image_path()), *REQUEST,
                            *flags)


@pytest.mark.multirank
def test_one_and_four_ranks_write_the_same_bytes(folder, tmp_path):
    one = _generate(folder, tmp_path / "one.mp4", 1)
    four = _generate(folder, tmp_path / "four.mp4", 4, "--enable-expert-parallel",
                     "--expert-parallel-size", "2", "--offload")
    assert (one["video_sha256"], one["audio_sha256"]) == (
        four["video_sha256"], four["audio_sha256"])
    data = _image_path().read_bytes()
    assert four["image"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert four["image"]["bytes"] == len(data) and four["image"]["source_size"] == [37, 23]
    assert (four["image"]["height"], four["image"]["width"]) == (
        one["image"]["height"], one["image"]["width"])
    assert four["image"]["prompt"] == i2v.ensure_figure_token(PROMPT)
    assert four["model"]["image_encoder"] == str(folder / "vae")


def test_memory_counts_the_image(folder):
    """The planner's encoder bytes equal the loaded encoder's; it sits on rank 0 only; the
    admission's image rows bound every image's rows at the request size."""
    from headmoe.admission import request_shape
    from headmoe.config import ParallelConfig as PC
    from headmoe.distributed.topology import plan_topology
    from headmoe.models.magi2.packing import image_rows
    from headmoe.planner.components import component_bytes, component_bytes_per_rank
    from headmoe.release import wan_vae

    parts = component_bytes("tiny", image=True)
    vae = wan_vae.load_wan_encoder(folder / "vae")
    assert parts.image_encoder == sum(p.numel() * 4 for p in vae.parameters())
    assert component_bytes("tiny").image_encoder == 0
    topo = plan_topology(4, PC(ulysses_degree=4))
    held = component_bytes_per_rank(topo, parts, 4)
    t2v = component_bytes_per_rank(topo, component_bytes("tiny"), 4)
    assert [a - b for a, b in zip(held, t2v)] == [parts.image_encoder, 0, 0, 0]
    req = GenerateRequest(prompt=PROMPT, height=64, width=96, num_frames=5)
    bound = request_shape(req, None, image=True).image_tokens
    assert request_shape(req, None).image_tokens == 0 and bound == image_rows(6, 6)
    for name in ("landscape_37x23", "portrait_20x50"):
        ref = prepare_image(_image_path(name).read_bytes(), 64, 96)
        assert image_rows(*ref.latent_size) <= bound
