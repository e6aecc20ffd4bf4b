"""The release folder end to end: found, checked before any rank starts (missing, unreadable,
renamed and mis-shaped files named), and run on 1 and 4 ranks with the same bytes.

One folder (the embedded tiny release, written by `tiny_release`: the release's file names
and key layouts with tiny random components) serves every test; tests that break a file
work on a hard-linked copy and replace files instead of writing into them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import headmoe.cli.generate as generate_cli
from headmoe.cli.main import build_parser, main
from headmoe.distributed import ParallelContext
from headmoe.models.magi2 import Magi2Config, get_config
from headmoe.pipeline.media import read_mp4
from headmoe.release import folder as release
from headmoe.release import placement
from headmoe.release.text_encoder import Qwen35TextEncoder

HEADMOE = str(Path(sys.executable).with_name("headmoe"))
REQUEST = ["--height", "32", "--width", "48", "--num-frames", "5", "--num-inference-steps", "2",
           "--prompt", "a red fox running through snow at dusk", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def folder(cache) -> Path:
    return release.tiny_release(cache)


@pytest.fixture
def copy(folder, tmp_path) -> Path:
    """A hard-linked copy of the folder (files must be replaced, never written into)."""
    dst = tmp_path / "MAGI-2-preview"
    shutil.copytree(folder, dst, copy_function=os.link)
    return dst


def _replace(path: Path, write) -> None:
    path.unlink()  # break the hard link before writing
    write(str(path))


def _refused(model: Path, tmp_path: Path, capsys, monkeypatch, *flags: str) -> str:
    """Run generate on 4 ranks; assert it stops before launching, with exit code 2 and no
    output; return the one-line error."""
    launched = []
    monkeypatch.setattr(generate_cli, "launch_local", lambda *a, **k: launched.append(a))
    out = tmp_path / "o.mp4"
    code = main(["generate", "--model", str(model), "--nproc", "4", "--ulysses-degree", "4",
                 "--enable-expert-parallel", "--expert-parallel-size", "2", "--output",
                 str(out), *REQUEST, *flags])
    err = capsys.readouterr().err
    assert code == 2 and not launched and not out.exists(), err
    assert err.startswith("headmoe: error: ") and err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------------- the folder
def test_public_config_round_trip():
    for name in ("tiny", "magi2-preview"):
        cfg = get_config(name)
        assert Magi2Config.from_dict(release.public_config(cfg), name=name) == cfg


def test_tiny_release_written_once_in_the_release_layout(folder, cache):
    assert folder.parent == cache and folder.name == release.tiny_release_name()
    stamp = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    assert release.tiny_release(cache) == folder  # second call: nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == stamp
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temp folder left
    for rel in release.required_files("turbo") + release.required_files("wan2.2"):
        assert (folder / rel).is_file(), rel
    index = json.loads((folder / "preview" / release.TRANSFORMER_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the release
    assert get_config("tiny").text_in_channels == 64  # = the tiny text encoder's width


@pytest.mark.parametrize("video", release.VIDEO_DECODERS)
def test_found_and_checked(folder, video):
    found = release.find_release(folder, video)
    assert found.transformer == str(folder / "preview" / release.TRANSFORMER_INDEX)
    assert found.video_decoder_path == str(folder / release.VIDEO_DECODER_DIRS[video])
    assert found.model_config == get_config("tiny").__class__(
        **{**get_config("tiny").to_dict(), "name": folder.name})
    release.check_release(found)


MISSING = [
    (f"preview/{release.TRANSFORMER_INDEX}", ()),
    ("text_encoder/config.json", ()),
    ("text_encoder/tokenizer.json", ()),
    ("text_encoder/model.safetensors", ()),
    ("turbo_vae/TurboV3-Wan22-TinyShallow_7_7.json", ()),
    ("turbo_vae/checkpoint.ckpt", ()),
    ("vae/Wan2.2_VAE.pth", ("--video-decoder", "wan2.2")),
    ("stable-audio-open-1.0/model_config.json", ()),
    ("stable-audio-open-1.0/model.safetensors", ()),
]


@pytest.mark.parametrize(("name", "flags"), MISSING, ids=[m[0] for m in MISSING])
def test_missing_file_is_named_before_any_rank(name, flags, copy, tmp_path, capsys,
                                                monkeypatch):
    (copy / name).unlink()
    err = _refused(copy, tmp_path, capsys, monkeypatch, *flags)
    if name.endswith(".index.json"):
        name = "preview/*.safetensors.index.json"
    assert f"{name} (missing)" in err, err


def test_missing_shard_and_empty_file(folder, copy, tmp_path, capsys, monkeypatch):
    index = json.loads((copy / "preview" / release.TRANSFORMER_INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (copy / "preview" / shard).unlink()
    err = _refused(copy, tmp_path, capsys, monkeypatch)
    assert f"shard file '{shard}' is missing" in err, err
    os.link(folder / "preview" / shard, copy / "preview" / shard)
    _replace(copy / "text_encoder" / "model.safetensors", lambda p: open(p, "wb").close())
    err = _refused(copy, tmp_path, capsys, monkeypatch)
    assert "text_encoder/model.safetensors (empty)" in err, err


def test_corrupt_file_is_named(copy, tmp_path, capsys, monkeypatch):
    path = copy / "stable-audio-open-1.0" / "model.safetensors"
    _replace(path, lambda p: Path(p).write_bytes(b"\x00" * 64))
    err = _refused(copy, tmp_path, capsys, monkeypatch)
    assert f"{str(path)!r} is not a readable safetensors file" in err, err


def _rename_safetensors(path: Path, old: str, new: str) -> None:
    tensors = load_file(str(path))
    tensors[new] = tensors.pop(old)
    _replace(path, lambda p: save_file(tensors, p))


def _rename_pickle(path: Path, old: str, new: str, inner: str | None = None) -> None:
    obj = torch.load(path, weights_only=True)
    state = obj[inner] if inner else obj
    state[new] = state.pop(old)
    _replace(path, lambda p: torch.save(obj, p))


def _rename_transformer(copy: Path) -> tuple[str, str]:
    path = copy / "preview" / release.TRANSFORMER_INDEX
    index = json.loads(path.read_text())
    old = sorted(index["weight_map"])[0]
    new = old.replace(".", "._renamed_", 1)
    _rename_safetensors(copy / "preview" / index["weight_map"][old], old, new)
    index["weight_map"][new] = index["weight_map"].pop(old)
    _replace(path, lambda p: Path(p).write_text(json.dumps(index)))
    return old, new


def _rename_in(copy: Path, part: str) -> tuple[str, str]:
    if part == "transformer":
        return _rename_transformer(copy)
    if part == "text_encoder":
        path = copy / "text_encoder/model.safetensors"
        old = next(k for k in sorted(load_file(str(path))) if k.startswith("layers.1."))
        new = old.replace("layers.1.", "layers.1.renamed_", 1)
        _rename_safetensors(path, old, new)
        return old, new
    if part == "audio":
        path = copy / "stable-audio-open-1.0/model.safetensors"
        old = "pretransform.model.decoder.layers.1.layers.1.weight_v"
        _rename_safetensors(path, old, old.replace("weight_v", "weight_u"))
        return "block.0.conv_t1.weight_v", old.replace("weight_v", "weight_u")  # diffusers'
    if part == "turbo":
        path = copy / "turbo_vae" / "checkpoint.ckpt"
        old = "module.decoder.conv_in.conv.weight"
        _rename_pickle(path, old, "module.decoder.conv_input.conv.weight", "ema_state_dict")
        return old, "module.decoder.conv_input.conv.weight"
    _rename_pickle(copy / "vae" / "Wan2.2_VAE.pth", "decoder.head.2.weight",
                   "decoder.head.2.weights")
    return "decoder.conv_out.weight", "decoder.head.2.weights"  # missing: diffusers' name


@pytest.mark.parametrize("part", ["transformer", "text_encoder", "turbo", "wan2.2", "audio"])
def test_renamed_tensor_is_named_before_any_rank(part, copy, tmp_path, capsys, monkeypatch):
    old, new = _rename_in(copy, part)
    flags = ("--video-decoder", "wan2.2") if part == "wan2.2" else ()
    err = _refused(copy, tmp_path, capsys, monkeypatch, *flags)
    assert old.removeprefix("module.") in err and new in err, err


def test_mis_shaped_tensor_is_named(copy, tmp_path, capsys, monkeypatch):
    path = copy / "turbo_vae" / "checkpoint.ckpt"
    obj = torch.load(path, weights_only=True)
    name = "module.decoder.conv_in.conv.bias"
    obj["ema_state_dict"][name] = obj["ema_state_dict"][name][:-1].clone()
    _replace(path, lambda p: torch.save(obj, p))
    err = _refused(copy, tmp_path, capsys, monkeypatch)
    assert "mis-shaped" in err and name in err, err


def test_config_mismatch_names_the_configuration_and_tensors(copy, tmp_path, capsys,
                                                             monkeypatch):
    cfg = json.loads((copy / "preview" / "config.json").read_text())
    cfg["text_in_channels"] = 40
    _replace(copy / "preview" / "config.json", lambda p: Path(p).write_text(json.dumps(cfg)))
    err = _refused(copy, tmp_path, capsys, monkeypatch)
    assert "config 'MAGI-2-preview': 1 mis-shaped tensors: pre_adapter.text_embedder.weight " \
        "expected [1536, 40] F32, found [1536, 64] F32" in err, err
    err = _refused(copy, tmp_path, capsys, monkeypatch, "--model-config", "magi2-preview")
    assert "holds 6 transformer layers (block.layers.0..5) but --model config " \
        "'MAGI-2-preview' has num_layers=40" in err, err


def test_release_as_published_is_read_as_magi2_preview(copy, tmp_path, capsys, monkeypatch):
    """The published folder has no preview/config.json (issue 22 point 1): it means the
    magi2-preview configuration, so the tiny weights are refused before any rank starts,
    naming the configuration, the layer count (checked against the index before a skeleton
    of an unbounded size is built) and the first mismatched tensors."""
    (copy / "preview" / "config.json").unlink()
    err = _refused(copy, tmp_path, capsys, monkeypatch)
    assert "holds 6 transformer layers (block.layers.0..5) but --model config " \
        "'magi2-preview' has num_layers=40; " in err, err
    assert "mis-shaped tensors: pre_adapter.video_embedder.weight expected [12288, 48], " \
        "found [1536, 48]" in err, err
    assert err.count("\n") <= 1 and len(err) < 2000, err


def test_release_as_published_runs_with_model_config(folder, copy, tmp_path):
    """Without preview/config.json and tokenizer_config.json (both optional), with
    --model-config <its config.json>: the same bytes as the folder with both files."""
    config = tmp_path / "config.json"
    shutil.copy(copy / "preview" / "config.json", config)
    (copy / "preview" / "config.json").unlink()
    (copy / "text_encoder" / "tokenizer_config.json").unlink()
    hashes = []
    for model, flags in ((folder, []), (copy, ["--model-config", str(config)])):
        out = tmp_path / f"{len(hashes)}.mp4"
        code = main(["generate", "--model", str(model), *flags, "--output", str(out),
                     *REQUEST, "--num-inference-steps", "1"])  # the last value wins
        side = json.loads(out.with_suffix(".json").read_text())
        assert code == 0 and side["admission"]["recipe"] == "tiny", side["admission"]
        hashes.append((side["video_sha256"], side["audio_sha256"]))
    assert hashes[0] == hashes[1]


# ---------------------------------------------------------------------- components
def test_decoder_sizes_follow_the_release_formulas(folder):
    ctx = ParallelContext.single()
    gen = torch.Generator().manual_seed(0)
    for video, lengths in (("turbo", (1, 9)), ("wan2.2", (1, 2))):  # 9: two TurboV3 windows
        dec = placement.output_video_decoder(ctx, release.find_release(folder, video))
        for t in lengths:
            frames = dec.decode(torch.randn((t, 1, 2, 48), generator=gen), 4 * (t - 1) + 1)
            assert frames.shape == (4 * (t - 1) + 1, 16, 32, 3) and frames.dtype == torch.uint8
        assert dec.latent_shape(5, 32, 48) == (2, 2, 3)
    audio = placement.output_audio_decoder(ctx, release.find_release(folder))
    for t in (1, 26):
        z = torch.randn((t, 64), generator=gen)
        assert audio.decoder.decode_51200(z).shape == (2, 2048 * t)
        assert audio.decode(z, 1764 * t).shape == (2, 2048 * t * 441 // 512)
    assert audio.latent_length(5 / 12.5) == 10 and audio.sample_rate == 44100


def test_component_bits_do_not_depend_on_the_callers_threads(folder):
    audio = placement.output_audio_decoder(ParallelContext.single(), release.find_release(folder))
    z = torch.randn((10, 64), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(audio.decode(z, 17640))
            assert torch.get_num_threads() == n  # restored
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_text_report_and_truncation(folder):
    enc = Qwen35TextEncoder.from_folder(folder / "text_encoder", dtype=torch.float32,
                                        max_tokens=3)
    node = placement.NodeTextEncoder(enc, 64, 0, None, 1, torch.device("cpu"), offload=True)
    feats, report = node.encode_with_report("a red fox running through snow")
    assert feats.shape == (3, 64) and report["kept"] == 3 and report["truncated"]
    assert report["tokens"] == len(enc.tokenizer("a red fox running through snow")["input_ids"])
    assert torch.equal(feats, enc.encode("a red fox running through snow"))


# ---------------------------------------------------------------------- end to end
def _generate(folder: Path, out: Path, nproc: int, *flags: str) -> dict:
    layout = ["--ulysses-degree", str(nproc)] if nproc > 1 else []
    cmd = [HEADMOE, "generate", "--model", str(folder), "--nproc", str(nproc), *layout,
           "--output", str(out), "--timeout", "120", *REQUEST, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.multirank
def test_one_and_four_ranks_write_the_same_bytes(folder, tmp_path):
    one = _generate(folder, tmp_path / "one.mp4", 1)
    four = _generate(folder, tmp_path / "four.mp4", 4, "--enable-expert-parallel",
                     "--expert-parallel-size", "2", "--offload")
    assert (one["video_sha256"], one["audio_sha256"]) == (
        four["video_sha256"], four["audio_sha256"])
    assert four["layout"]["world_size"] == 4 and four["model"]["release"] == str(folder)
    assert four["model"]["video_decoder"] == "turbo" and four["model"]["offload"]
    assert four["text"]["prompt"]["tokens"] > 1 and not four["text"]["prompt"]["truncated"]
    assert four["text"]["max_tokens"] == 7000
    assert four["latents"] == {"video": [2, 2, 3, 48], "audio": [10, 64]}
    frames, audio, fps, rate = read_mp4(tmp_path / "four.mp4")
    assert frames.shape == (5, 32, 48, 3) and audio.shape[0] == 2 and rate == 44100
    assert four["media"]["audio_samples"] == [2, 17640]


def _boom(texts):
    raise ValueError("encoder exploded")


def _node_broadcast(rank, world_size, folder):
    """Rank body: two nodes of two ranks; encode, then encode with a failing encoder. The
    harness launches the 4 ranks as one node; torchrun would give each node's ranks local
    ranks 0 and 1, which is what they are told here."""
    import os
    from datetime import timedelta

    from headmoe.config import ParallelConfig

    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    ctx = ParallelContext.initialize(ParallelConfig(ulysses_degree=4),
                                     timeout=timedelta(seconds=60))
    try:
        enc = placement.node_text_encoder(ctx, release.find_release(folder),
                                          timedelta(seconds=60), node_size=2)
        feats, report = enc.encode_with_report("a red fox running through snow at dusk")
        out = {"loaded": enc.encoder is not None, "src": enc.src, "feats": feats,
               "report": report}
        if enc.encoder is not None:
            enc.encoder.encode_batch = _boom
        try:
            enc.encode("x")
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        ctx.destroy()


@pytest.mark.multirank
def test_text_features_reach_every_rank_of_each_node(folder):
    from headmoe.release.text_encoder import model_dtype
    from headmoe.testing import run_ranks

    per_rank = run_ranks(_node_broadcast, 4, args=(str(folder),), timeout=240)
    text = folder / "text_encoder"
    enc = Qwen35TextEncoder.from_folder(text, dtype=model_dtype(text))
    threads = torch.get_num_threads()
    torch.set_num_threads(placement.CPU_THREADS)  # as `Placed.use` on a CPU rank
    try:
        want = enc.encode("a red fox running through snow at dusk")
    finally:
        torch.set_num_threads(threads)
    assert [r["loaded"] for r in per_rank] == [True, False, True, False]
    assert [r["src"] for r in per_rank] == [0, 0, 2, 2]
    for r in per_rank:
        assert torch.equal(r["feats"], want) and r["report"]["kept"] == want.shape[0]
    for rank, r in enumerate(per_rank):
        expect = ("ValueError: encoder exploded" if rank in (0, 2) else
                  f"RuntimeError: the text encoder failed on rank {rank // 2 * 2}")
        assert r["error"].startswith(expect), r["error"]


def test_unused_component_entries_are_recorded_not_refused(copy, tmp_path, capsys):
    """Extra keys in the TurboV3 and stable-audio JSON and training-only state in
    checkpoint.ckpt: the reference ignores them; headmoe warns and records them."""
    from headmoe.release import audio_vae, turbo_vae

    turbo = copy / "turbo_vae"
    data = json.loads((turbo / turbo_vae.CONFIG_FILE).read_text())
    _replace(turbo / turbo_vae.CONFIG_FILE,
             lambda p: Path(p).write_text(json.dumps({**data, "ema_decay": 0.999})))
    ckpt = torch.load(turbo / turbo_vae.CHECKPOINT_FILE, weights_only=True)
    _replace(turbo / turbo_vae.CHECKPOINT_FILE,
             lambda p: torch.save({**ckpt, "optimizer_step": torch.tensor(7)}, p))
    audio = copy / "stable-audio-open-1.0" / audio_vae.CONFIG_FILE
    cfg = json.loads(audio.read_text())
    cfg["model"]["pretransform"]["config"]["decoder"]["config"]["dropout"] = 0.0
    _replace(audio, lambda p: Path(p).write_text(json.dumps(cfg)))
    args = build_parser().parse_args(["generate", "--model", str(copy), "--prompt", "x",
                                      "--output", str(tmp_path / "o.mp4")])
    job, _ = generate_cli.build_job(args)
    unused = job.release.describe()["unused_entries"]
    assert f"turbo_vae/{turbo_vae.CONFIG_FILE}: aligned_blks_indices, " \
        "aligned_feature_projection_dim, aligned_feature_projection_mode, ema_decay" in unused
    assert any(e.startswith(f"turbo_vae/{turbo_vae.CHECKPOINT_FILE}: optimizer_step")
               for e in unused), unused
    assert f"stable-audio-open-1.0/{audio_vae.CONFIG_FILE} decoder config: dropout" in unused
    err = capsys.readouterr().err
    warned = [ln for ln in err.splitlines() if "component entries headmoe does not use" in ln]
    assert len(warned) == 1 and f"{len(unused)} component entries" in warned[0], err
    assert "ema_decay" not in err  # the list is in the sidecar, not the warning (issue 31)
