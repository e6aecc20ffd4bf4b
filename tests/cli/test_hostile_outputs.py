"""Silent wrong output and lost data (issue 23 points 6, 7, 8): NaN/Inf from a decoder, two
runs writing one output, SIGTERM in the middle of a write. Each ends in one line, exit 1
(a fault) or 143 (terminated), and leaves neither a black mp4, a replaced file nor a
``.tmp`` file or folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import headmoe.cli.generate as generate_cli
import headmoe.pipeline.job as job_mod
import headmoe.release.folder as release_mod
from headmoe.cli.main import main
from headmoe.errors import RuntimeFault
from headmoe.files import atomic_write
from headmoe.release import folder as release
from headmoe.release.components import resolve_model

SMALL = ["--height", "32", "--width", "32", "--num-frames", "1", "--num-inference-steps", "1",
         "--no-progress", "--prompt", "a fox"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cache")
    release.tiny_release(folder)
    resolve_model("tiny", folder)
    return folder


@pytest.fixture
def copy(cache, tmp_path) -> Path:
    dst = tmp_path / "rel"
    shutil.copytree(release.tiny_release(cache), dst, copy_function=os.link)
    return dst


def one_line(capsys, code: int, expected: int, *needles: str) -> str:
    err = capsys.readouterr().err
    # start-up notes and progress lines ("headmoe: note: ...", "headmoe: loading ...") come
    # first; the failure is one line
    lines = [ln for ln in err.splitlines() if ln.strip() and (
        ln.startswith(("headmoe: error: ", "headmoe: terminated")) or not ln.startswith("headmoe:"))]
    assert code == expected, err
    assert len(lines) == 1 and lines[0].startswith("headmoe: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def no_leftovers(folder: Path) -> None:
    names = [p.name for p in folder.rglob("*")] if folder.exists() else []
    assert not [n for n in names if n.endswith(".tmp")], names


def _poison_turbo(folder: Path) -> str:
    path = folder / release.TURBO_DIR / "checkpoint.ckpt"
    ckpt = torch.load(path, weights_only=True)
    state = ckpt["ema_state_dict"]
    name = next(n for n in state if n.endswith("conv_out.conv.weight"))
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    path.unlink()
    torch.save(ckpt, path)
    return name


# ---------------------------------------------------------------------- point 6
def test_nan_decoder_weights_fail_the_run_not_a_black_mp4(copy, cache, tmp_path, capsys):
    _poison_turbo(copy)
    out = tmp_path / "out" / "o.mp4"
    out.parent.mkdir()
    code = main(["generate", "--model", str(copy), "--cache-dir", str(cache), "--output",
                 str(out), *SMALL])
    one_line(capsys, code, 1, "NaN in the decoded video after decoding",
             "--check-weights (it reads every tensor of the decoders)")
    assert not out.exists()
    no_leftovers(out.parent)


@pytest.mark.parametrize("decoder", ["turbo", "wan2.2", "audio", "text"])
def test_check_weights_scans_the_decoders(decoder, copy, cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate_cli, "launch_local", lambda *a, **k: pytest.fail("launched"))
    if decoder == "turbo":
        name, file = _poison_turbo(copy), "checkpoint.ckpt"
        name = f"ema_state_dict.{name}"
    elif decoder == "wan2.2":
        path = copy / release.WAN_DIR / "Wan2.2_VAE.pth"
        state = torch.load(path, weights_only=True)
        name = next(n for n in state if n.startswith("decoder.") and n.endswith(".weight"))
        file = "Wan2.2_VAE.pth"
        state[name] = torch.full_like(state[name], float("inf"))
        path.unlink()
        torch.save(state, path)
    else:
        path = copy / (release.AUDIO_DIR if decoder == "audio" else release.TEXT_ENCODER_DIR) \
            / "model.safetensors"
        state = load_file(path)
        name, file = next(n for n in state if n.endswith("bias")), "model.safetensors"
        state[name] = state[name].clone()
        state[name].view(-1)[-1] = float("nan")
        path.unlink()
        save_file(state, path)
    out = tmp_path / "o.mp4"
    flags = ["--video-decoder", "wan2.2"] if decoder == "wan2.2" else []
    code = main(["generate", "--model", str(copy), "--output", str(out), "--nproc", "2",
                 "--ulysses-degree", "2", "--check-weights", *flags, *SMALL])
    one_line(capsys, code, 2, file, "non-finite values in 1 tensor(s): " + name)
    assert not out.exists()


# ---------------------------------------------------------------------- point 7
def _tiny_ckpt(cache: Path) -> list[str]:
    return ["--model", resolve_model("tiny", cache, write=False)[1], "--model-config", "tiny"]


def test_output_written_meanwhile_by_another_run_is_kept(cache, tmp_path, capsys,
                                                         monkeypatch):
    out = tmp_path / "same.mp4"
    decode = job_mod.decode

    def other_run_finishes_first(*a, **k):
        out.write_bytes(b"the other run's video")
        out.with_suffix(".json").write_text("{}")
        return decode(*a, **k)

    monkeypatch.setattr(job_mod, "decode", other_run_finishes_first)
    code = main(["generate", *_tiny_ckpt(cache), "--output", str(out), *SMALL])
    one_line(capsys, code, 1, repr(str(out)), "created by another run", "--overwrite")
    assert out.read_bytes() == b"the other run's video"
    assert out.with_suffix(".json").read_text() == "{}"
    no_leftovers(tmp_path)
    code = main(["generate", *_tiny_ckpt(cache), "--output", str(out), "--overwrite", *SMALL])
    capsys.readouterr()
    assert code == 0 and out.read_bytes()[4:8] == b"ftyp"
    assert json.loads(out.with_suffix(".json").read_text())["video_sha256"]


def test_no_clobber_is_decided_at_the_rename(tmp_path):
    path = tmp_path / "x.bin"

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(b"mine")
        path.write_bytes(b"theirs")  # appears between the check and the rename

    with pytest.raises(RuntimeFault, match="created by another run"):
        atomic_write(path, write, overwrite=False)
    assert path.read_bytes() == b"theirs" and sorted(os.listdir(tmp_path)) == ["x.bin"]
    atomic_write(path, write, overwrite=True)
    assert path.read_bytes() == b"mine" and sorted(os.listdir(tmp_path)) == ["x.bin"]


# ---------------------------------------------------------------------- point 8
def test_sigterm_while_writing_the_output_leaves_no_tmp(cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o.mp4"
    write_mp4 = job_mod.write_mp4

    def terminated_mid_write(path, *a, **k):
        import headmoe.pipeline.media as media

        real = media.atomic_write

        def write_half(p, write, **kw):
            def half(tmp):
                Path(tmp).write_bytes(b"half an mp4")
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the temp file exists
            return real(p, half, **kw)

        monkeypatch.setattr(media, "atomic_write", write_half)
        return write_mp4(path, *a, **k)

    monkeypatch.setattr(job_mod, "write_mp4", terminated_mid_write)
    code = main(["generate", *_tiny_ckpt(cache), "--output", str(out), *SMALL])
    one_line(capsys, code, 128 + signal.SIGTERM, "terminated (SIGTERM)")
    assert sorted(os.listdir(tmp_path)) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the boundary restored it


def test_sigterm_during_the_first_cache_write_leaves_no_tmp_folder(tmp_path, capsys,
                                                                   monkeypatch):
    def killed_half_way(folder):
        (Path(folder) / "preview").mkdir(parents=True)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(release_mod, "write_tiny_release", killed_half_way)
    cache = tmp_path / "cache"
    code = main(["generate", "--cache-dir", str(cache), "--output", str(tmp_path / "o.mp4"),
                 *SMALL])
    one_line(capsys, code, 128 + signal.SIGTERM, "terminated (SIGTERM)")
    assert os.listdir(cache) == []
