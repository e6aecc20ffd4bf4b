"""`headmoe generate` end to end: flag validation, a real multi-rank run decoded back, and
a rank killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from headmoe.cli.flags import as_flags
from headmoe.cli.main import build_parser, main
from headmoe.pipeline.media import read_mp4
from headmoe.testing import spawned_rank_pids

HEADMOE = str(Path(sys.executable).with_name("headmoe"))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--expert-parallel-size", "3", "--ulysses-degree", "4", "--enable-expert-parallel"],
            "--expert-parallel-size=3 must divide --ulysses-degree=4",
        ),
        (
            ["--nproc", "4", "--ulysses-degree", "8"],
            "--nproc has 4 ranks but the layout needs --ulysses-degree 8",
        ),
        (
            ["--ulysses-degree", "16"],
            "num_attention_heads=24 must be divisible by --ulysses-degree=16",
        ),
        (
            ["--expert-parallel-size", "2", "--ulysses-degree", "2"],
            "--expert-parallel-size=2 requires --enable-expert-parallel",
        ),
        (["--cfg-parallel-size", "3", "--nproc", "3"], "--cfg-parallel-size=3 must be 1 or 2"),
        (["--width", "50"], "--width=50 must be a positive multiple of 16, e.g. 48"),
        (["--num-inference-steps", "0"], "--num-inference-steps=0 must be an integer in [1, 1000]"),
        (["--output", "x.avi"], "--output must end in .mp4"),
        (["--model", "nowhere.safetensors"], "--model must be 'tiny', a release folder or an existing"),
        (["--timeout", "0"], "--timeout must be at least 1 s"),
        (["--timeout", "0.001"], "--timeout must be at least 1 s (it also bounds joining the "
                                 "ranks) and at most 604800 s, got 0.001"),
        (["--timeout", "nan"], "--timeout must be at least 1 s"),
        (["--timeout", "1e308"], "and at most 604800 s, got 1e+308"),  # issue 32 point 10
    ],
)
def test_invalid_flags_fail_before_any_rank(flags, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "generate",
            "--prompt",
            "x",
            "--cache-dir",
            str(tmp_path / "c"),
            "--output",
            str(tmp_path / "o.mp4"),
            *flags,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err
    assert not (tmp_path / "o.mp4").exists()


def test_cuda_noise_refused_without_cuda(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["generate", "--prompt", "x", "--cache-dir", str(tmp_path / "c"), "--output",
                 str(tmp_path / "o.mp4"), "--noise-device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--noise-device='cuda' draws the noise on the GPU, but no CUDA" in err
    assert not (tmp_path / "o.mp4").exists()


def test_as_flags_only_rewrites_field_names():
    assert (
        as_flags("seed must be a non-negative int, got -1")
        == "--seed must be a non-negative int, got -1"
    )
    assert as_flags("x for a head-style model") == "x for a head-style model"
    assert as_flags("negative_prompt must be a str") == "--negative-prompt must be a str"
    # issue 32 point 10: a word of another message is not a field
    quoted = "x.ckpt: cannot be read (RuntimeError: Storage size calculation overflowed)"
    assert as_flags(quoted) == quoted
    assert as_flags("seed 5 (ValueError: size 3) and seed 4") == \
        "--seed 5 (ValueError: size 3) and --seed 4"


def test_parser_has_generate_and_required_prompt():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate"])
    args = parser.parse_args(["generate", "--prompt", "p"])
    assert args.model == "tiny" and args.nproc is None and args.fps is None  # admission fills it


@pytest.mark.multirank
def test_console_command_writes_playable_mp4(tmp_path):
    out = tmp_path / "demo.mp4"
    cmd = [
        HEADMOE,
        "generate",
        "--prompt",
        "a lighthouse at dusk",
        "--nproc",
        "4",
        "--ulysses-degree",
        "4",
        "--enable-expert-parallel",
        "--expert-parallel-size",
        "2",
        "--num-inference-steps",
        "3",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--output",
        str(out),
        "--timeout",
        "120",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "denoising" in proc.stderr and f"wrote {out}" in proc.stdout
    frames, audio, fps, rate = read_mp4(out)
    assert frames.shape == (13, 64, 96, 3) and fps == 12.5 and rate == 44100
    assert abs(audio.shape[1] / rate - 13 / 12.5) < 2048 / rate  # AAC frame padding
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["layout"]["world_size"] == 4 and side["layout"]["expert_parallel_size"] == 2
    assert sorted(side["step_times_s"]["per_rank"]) == ["0", "1", "2", "3"]
    assert len(side["step_times_s"]["max"]) == 3
    assert all(side["counters"][r]["moe_calls"] > 0 for r in "0123")
    assert len(side["video_sha256"]) == 64 and len(side["audio_sha256"]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "demo.json", "demo.mp4"]


def _worker_pids(parent):
    """Spawned rank processes under ``parent`` (the launcher)."""
    return spawned_rank_pids(parent)


@pytest.mark.multirank
def test_killed_rank_fails_the_command_and_leaves_no_output(tmp_path):
    out = tmp_path / "killed.mp4"
    timeout = 60
    cmd = [
        HEADMOE,
        "generate",
        "--prompt",
        "x",
        "--nproc",
        "2",
        "--ulysses-degree",
        "2",
        "--num-inference-steps",
        "200",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--output",
        str(out),
        "--timeout",
        str(timeout),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = bytearray()
    reader = threading.Thread(
        target=lambda: [err.extend(c) for c in iter(lambda: proc.stderr.read1(4096), b"")],
        daemon=True,
    )
    reader.start()
    deadline = time.monotonic() + 180
    while b" 2/200 " not in err and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, err.decode(errors="replace")
    victims = _worker_pids(proc.pid)
    assert len(victims) == 2, victims
    os.kill(victims[1], signal.SIGKILL)
    t_kill = time.monotonic()
    code = proc.wait(timeout=timeout + 30)
    elapsed = time.monotonic() - t_kill
    reader.join(timeout=5)
    text = err.decode(errors="replace")
    assert code == 1 and elapsed < timeout, (code, elapsed, text)
    assert "failed" in text and "killed by signal 9" in text
    assert not out.exists() and not out.with_suffix(".json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_torchrun_env(monkeypatch):
    from headmoe.distributed.launch import RankEnv, torchrun_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert torchrun_env() is None  # LOCAL_RANK missing: not a launched rank
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun_env() == RankEnv(5, 8, 1, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert torchrun_env() == RankEnv(5, 8, 1, 4)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK must be an int, got 'x'"):
        torchrun_env()


def test_nproc_must_match_torchrun_world(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    code = main(
        [
            "generate",
            "--prompt",
            "x",
            "--nproc",
            "4",
            "--ulysses-degree",
            "4",
            "--cache-dir",
            str(tmp_path),
        ]
    )
    assert (
        code == 2 and "--nproc 4 does not match the torchrun world of 2" in capsys.readouterr().err
    )
    code = main(
        ["generate", "--prompt", "x", "--ulysses-degree", "4", "--cache-dir", str(tmp_path)]
    )
    assert code == 2 and "the torchrun world has 2 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("cuda", [False, True])
def test_one_rank_runs_where_launched_ranks_run(cuda, monkeypatch, tmp_path):
    """Launched ranks use NCCL on cuda when CUDA is available, so a one-rank run must use the
    GPU too (else `compare` would set CPU bytes against GPU bytes). The job is recorded, not
    run: this machine has no GPU."""
    import torch

    import headmoe.pipeline.job as job_mod

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(job_mod, "run_job", lambda ctx, job: seen.append(ctx.device) or {
        "output": None})
    code = main(["generate", "--prompt", "x", "--cache-dir", str(tmp_path), "--output",
                 str(tmp_path / "o.mp4"), "--no-progress"])
    assert code == 0 and seen == [torch.device("cuda", 0) if cuda else torch.device("cpu")]
