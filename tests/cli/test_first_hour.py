"""A user's first hour with a release folder (issue 31): no flag prefix matching, a `plan`
command that runs as printed, one-line warnings, the time estimate, the HTTP model field."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import headmoe.cli.generate as generate_cli
from headmoe.cli.main import build_parser, main


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--offload"], "--offload"),
    (["generate", "--prompt", "x", "--num-inference", "2"], "--num-inference"),
    (["plan", "--world", "8"], "--world"),
    (["compare", "--layouts", "sp1", "--repe", "2"], "--repe"),
])
def test_no_subcommand_accepts_a_prefix_of_a_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert f"unrecognized arguments: {flag}" in err, err
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        assert sub.allow_abbrev is False, name


def _printed_command(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("Run it with: "))
    return shlex.split(line.removeprefix("Run it with: "))


@pytest.mark.parametrize("world, stream, fmt", [
    *((w, s, None) for w in (1, 2, 8) for s in (False, True)), (2, False, "fp8")])
def test_plans_printed_command_runs_the_plan(world, stream, fmt, tmp_path, capsys, monkeypatch,
                                             tiny_release_in):
    import headmoe.pipeline.job as job_module

    folder = tiny_release_in(tmp_path / "cache")
    flags = ["--offload-layers", "--resident-layers", "1"] if stream else []
    flags += ["--expert-format", fmt] if fmt else []
    command = _printed_command(["plan", "--model", str(folder), "--world-size", str(world),
                                "--text-tokens", "8", *flags], capsys)
    assert command[:2] == ["headmoe", "generate"] and command[command.index("--model") + 1] \
        == str(folder), command
    assert ("--offload-layers" in command) == stream and ("--resident-layers" in command) == stream
    assert ("--expert-format" in command) == (fmt is not None) and (
        fmt is None or command[command.index("--expert-format") + 1] == fmt), command
    jobs = []
    monkeypatch.setattr(generate_cli, "launch_local", lambda fn, n, a: jobs.append((n, a[0])) or [])
    monkeypatch.setattr(job_module, "run_job", lambda ctx, job: jobs.append((1, job)) or
                        {"output": None})
    monkeypatch.chdir(tmp_path)
    assert main(command[1:]) == 0  # as printed: every check up to starting the ranks
    (n, job), = jobs
    assert n == world == job.parallel.world_size
    assert job.offload_layers == stream and job.resident_layers == (1 if stream else 0)
    assert job.expert_format == (fmt or "bf16")
    req = job.request
    assert (req.height, req.width, req.num_frames) == (64, 96, 13)  # the tiny recipe's


def test_plans_printed_command_runs_as_printed(tmp_path, capsys, tiny_release_in):
    """The printed line itself, in a shell, on 2 ranks with streamed layers."""

    folder = tiny_release_in(tmp_path / "cache")
    command = _printed_command(["plan", "--model", str(folder), "--world-size", "2",
                                "--offload-layers"], capsys)
    exe = Path(sys.executable).with_name("headmoe")
    line = " ".join(shlex.quote(a) for a in [str(exe), *command[1:], "--no-progress"])
    out = subprocess.run(line, shell=True, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "output.mp4").is_file() and "on 2 rank(s)" in out.stdout


def test_plan_refusal_and_json_name_the_ways_out(capsys):
    assert main(["plan", "--world-size", "1"]) == 2
    assert "--offload-layers" in capsys.readouterr().err
    assert main(["plan", "--world-size", "16", "--json", "--seconds", "5",
                 "--size", "448x256"]) == 0
    data = json.loads(capsys.readouterr().out)
    command = data["command"]
    assert command[0] == "torchrun" and command[command.index("--nnodes") + 1] == "2"
    assert command[command.index("--size") + 1] == "448x256"
    assert command[command.index("--num-frames") + 1] == "61"  # 5 s at 12.5 fps
    assert data["request"]["video_latent"][1:] == [16, 28]


def _launch_nothing(monkeypatch, tmp_path):
    jobs = []
    monkeypatch.setattr(generate_cli, "launch_local", lambda fn, n, a: jobs.append(a[0]) or [])
    monkeypatch.chdir(tmp_path)
    return jobs


def test_unused_entries_are_one_line_and_rounding_is_said(tmp_path, capsys, monkeypatch,
                                                          tiny_release_in):

    folder = tiny_release_in(tmp_path / "cache")
    jobs = _launch_nothing(monkeypatch, tmp_path)
    assert main(["generate", "--model", str(folder), "--prompt", "a fox", "--seconds", "1",
                 "--nproc", "2", "--ulysses-degree", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    unused = jobs[0].release.describe()["unused_entries"]
    warning = [ln for ln in err if ln.startswith("headmoe: warning:")]
    assert unused and warning == [
        f"headmoe: warning: {len(unused)} component entries headmoe does not use (nor does the "
        "reference), listed in the sidecar's release.unused_entries"], err
    start = next(ln for ln in err if ln.startswith("headmoe: checked"))
    assert "starting 2 rank(s), " in start and "CPU thread(s) each" in start, start
    assert "9 frames at 12.5 fps = 0.72 s" in start, start
    notes = jobs[0].extra["admission"]["notes"]  # the sidecar's admission.notes
    assert any("0.72 s (rounded down from 1 s" in n for n in notes), notes


def test_time_estimate_is_printed_before_ranks_and_max_time_refuses(tmp_path, capsys,
                                                                     monkeypatch):
    jobs = _launch_nothing(monkeypatch, tmp_path)
    base = ["generate", "--prompt", "a fox", "--cache-dir", str(tmp_path / "cache"),
            "--nproc", "2", "--ulysses-degree", "2"]
    assert main(base) == 0 and len(jobs) == 1
    start = next(ln for ln in capsys.readouterr().err.splitlines() if "starting" in ln)
    assert "estimated ~" in start and jobs[0].extra["admission"]["time_estimate_s"] > 0, start
    assert main([*base, "--num-inference-steps", "1000", "--max-time", "5"]) == 2
    err = capsys.readouterr().err
    assert len(jobs) == 1 and err.count("\n") == 1, err  # refused before any rank
    assert "--num-inference-steps 1000" in err or "num-inference-steps=1000" in err, err
    assert "estimated" in err and "max-time" in err and "5 s" in err, err


def test_a_measured_step_replaces_the_flop_rate_estimate(tmp_path, capsys, monkeypatch):
    """A finished run records its median step (the first left out) under the cache dir;
    the next run of that cost is estimated from it, and the start-up line says which."""
    from headmoe.planner.time import STEP_TIMES_FILE

    jobs = []
    ran = {"output": None, "step_times_s": [30.0, 2.0, 4.0, 3.0]}
    monkeypatch.setattr(generate_cli, "launch_local", lambda fn, n, a: jobs.append(a[0]) or [ran])
    monkeypatch.chdir(tmp_path)
    base = ["generate", "--prompt", "a fox", "--cache-dir", str(tmp_path / "cache"),
            "--nproc", "2", "--ulysses-degree", "2", "--num-inference-steps", "4"]

    def start_line() -> str:
        return next(ln for ln in capsys.readouterr().err.splitlines() if "starting" in ln)

    assert main(base) == 0 and "(FLOP-rate estimate)" in start_line()
    assert main(base) == 0 and "estimated ~12 s of steps (measured steps)" in start_line()
    assert jobs[1].extra["admission"]["time_estimate_source"] == "measured"
    assert main([*base, "--size", "64x64"]) == 0 and "(FLOP-rate estimate)" in start_line()
    assert main([*base, "--max-time", "10"]) == 2 and len(jobs) == 3
    err = capsys.readouterr().err
    assert "estimated 12 s (measured steps)" in err and "max-time" in err, err
    (tmp_path / "cache" / STEP_TIMES_FILE).write_text("{not json")  # a cache: ignored
    assert main(base) == 0 and "(FLOP-rate estimate)" in start_line()


def test_release_recipe_on_a_cpu_is_estimated_in_hours():
    from headmoe.admission import admit
    from headmoe.errors import Refusal
    from headmoe.models.magi2 import get_config
    from headmoe.pipeline.deployment import Deployment

    dep = Deployment(model_config=get_config("magi2-preview"), device="cpu", threads=2, max_time_s=3600)
    with pytest.raises(Refusal) as exc:
        admit({"prompt": "a red fox"}, dep)  # 540p, 125 frames, 100 steps
    assert " h " in exc.value.message and "max_time=3600 s" in exc.value.message
    small = admit({"prompt": "a red fox", "num_inference_steps": 1, "size": "96x64",
                   "seconds": 2}, Deployment(model_config=get_config("tiny"), threads=1, max_time_s=3600))
    assert small.time.seconds < 60


def test_openmp_threads_sleep_unless_the_environment_says_otherwise():
    """Point 3: the lone rank's 2 threads on 2 shared cores spun (20x slower); headmoe's
    import makes a waiting OpenMP thread sleep before torch loads its runtime."""
    code = ("import os; import headmoe, torch; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['KMP_BLOCKTIME'])")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.stdout.split() == ["PASSIVE", "0"], out
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**env, "OMP_WAIT_POLICY": "ACTIVE"})
    assert out.stdout.split() == ["ACTIVE", "0"], out


def test_plan_takes_a_folders_expert_format_and_refuses_what_generate_would(tmp_path, capsys,
                                                                            tiny_release_in):
    """A bf16 folder: FP8 with streamed layers is refused as generate refuses it; its
    `headmoe quantize` copy plans FP8 without the flag and prints it in the command."""
    from headmoe.release.quantize import quantize_release

    folder = tiny_release_in(tmp_path / "cache")
    plan = ["plan", "--world-size", "2", "--text-tokens", "8"]
    assert main([*plan, "--model", str(folder), "--expert-format", "fp8",
                 "--offload-layers"]) != 0
    err = capsys.readouterr().err
    assert "offload_layers" in err and "expert_format='fp8'" in err, err
    fp8 = quantize_release(folder, tmp_path / "fp8")
    command = _printed_command([*plan, "--model", str(fp8), "--offload-layers"], capsys)
    assert command[command.index("--expert-format") + 1] == "fp8", command
    assert main([*plan, "--model", str(fp8), "--expert-format", "bf16"]) != 0
    assert "contradicts" in capsys.readouterr().err
