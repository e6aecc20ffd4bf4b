"""The first hour of a new user (issue 23 points 15-17, 19): the random tiny release says
so, start-up is not silent, the thread count follows the cores the process may use, and the
small things (``--version``, ``python -m headmoe``, "did you mean", docs that cite only files
of the repository, outputs of the README commands git-ignored)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import headmoe
import headmoe.cli.generate as generate_cli
import headmoe.distributed.context as launch
from headmoe.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_release_run_says_the_weights_are_random(tmp_path, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(generate_cli, "launch_local", lambda *a, **k: launched.append(a) or [])
    code = main(["generate", "--prompt", "a fox", "--cache-dir", str(tmp_path / "cache"),
                 "--output", str(tmp_path / "o.mp4"), "--nproc", "2", "--ulysses-degree", "2",
                 "--num-inference-steps", "1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0 and len(launched) == 1, err
    assert "random weights" in err[0] and "coloured noise" in err[0] and "--model PATH" in err[0]
    assert err[1].startswith("headmoe: checked the request and the model; starting 2 rank(s)")
    main(["generate", "--prompt", "a fox", "--cache-dir", str(tmp_path / "cache"), "--output",
          str(tmp_path / "o.mp4"), "--nproc", "2", "--ulysses-degree", "2", "--no-progress"])
    assert "starting" not in capsys.readouterr().err  # --no-progress: no start-up lines
    readme = (ROOT / "README.md").read_text()
    assert "**The output is noise, on purpose.** The tiny release has *random* weights" in readme


@pytest.mark.parametrize("affinity, quota, local, threads", [
    (8, None, 4, 2), (8, "150000 100000", 1, 2), (2, None, 4, 1), (16, "max 100000", 2, 8)])
def test_threads_follow_the_cores_this_process_may_use(affinity, quota, local, threads,
                                                       tmp_path, monkeypatch):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    cpu_max = tmp_path / "cpu.max"
    if quota:
        cpu_max.write_text(quota + "\n")
    monkeypatch.setattr(launch, "CGROUP_CPU_MAX", str(cpu_max))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.get_num_threads()
    try:
        assert launch.set_rank_threads(local) == threads
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_version_and_python_m():
    out = subprocess.run([sys.executable, "-m", "headmoe", "--version"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"headmoe {headmoe.__version__}", out


@pytest.mark.parametrize("argv, hint", [
    (["generate", "--prompt", "x", "--ulysess-degree", "2"], "(did you mean --ulysses-degree?)"),
    (["generate", "--prompt", "x", "--negative-promt", "y", "--sed", "3"],
     "(did you mean --negative-prompt / --seed?)"),
    (["serv"], "(did you mean serve?)"),
    (["generate", "--promt", "x"], "(did you mean --prompt?)"),
    (["plan", "--bogus"], None),
])
def test_unknown_flag_suggests_the_close_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("headmoe: error: ")
    assert (hint in err) if hint else "did you mean" not in err, err


def test_docs_and_sources_cite_only_files_of_the_repository():
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py"),
             *(ROOT / "benchmarks").rglob("*.py")]
    citing = [str(p.relative_to(ROOT)) for p in texts if "../shared" in p.read_text()]
    assert citing == []


def test_readme_outputs_are_git_ignored():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    for pattern in ("*.mp4", "/demo.json", "/videos/", "/headmoe-videos/"):
        assert pattern in ignored


# ---------------------------------------------------------------------- point 18: plan
def test_plan_16_ranks_follows_the_guides_exchange_rule():
    from headmoe.models.magi2.config import get_config
    from headmoe.planner import RequestShape, plan_world

    request = RequestShape((32, 16, 28), 250, (250, 250))
    plans, reason = plan_world(get_config("magi2-preview"), request, 16,
                               memory_bytes=80 << 30)
    best = next(p for p in plans if p.recommended)
    twin = next(p for p in plans if p.name == best.name.replace("ep_group", "sp_group"))
    # sp_group saves 6 of 22,260 rows (within E x heads = 12 of the SP split's slack) at
    # more traffic: the guide's "auto is ep_group" rule keeps ep_group
    assert best.name == "sp8,cfg2,ep4,ep_group", reason
    assert 0 < best.busiest_moe_rows - twin.busiest_moe_rows <= 12
    assert twin.bytes_sent_per_forward > best.bytes_sent_per_forward


def test_plan_is_readable_and_prints_the_generate_flags(capsys, tmp_path, tiny_release_in):
    import dataclasses

    from headmoe.cli.flags import parallel_of
    from headmoe.cli.main import build_parser

    folder = tiny_release_in(tmp_path / "cache")
    assert main(["plan", "--model", str(folder), "--world-size", "4", "--height", "64",
                 "--width", "96", "--num-frames", "13", "--text-tokens", "8"]) == 0
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert table[0].count(" | ") + 1 <= 7 and max(map(len, table)) <= 120, table[0]
    assert f"model {folder.name}," in out  # the folder's own config
    command = next(ln for ln in out.splitlines() if ln.startswith("Run it with: "))
    argv = shlex.split(command.removeprefix("Run it with: headmoe "))
    args = build_parser().parse_args(argv)
    best = next(ln for ln in out.splitlines() if ln.startswith("Recommended: "))
    name = best.removeprefix("Recommended: ").split(" — ")[0]
    from headmoe.planner import layout_name

    par = parallel_of(args)
    assert layout_name(par) == name or layout_name(dataclasses.replace(
        par, moe_exchange="auto")) == name, (command, name)
    assert args.nproc == par.world_size == 4
    assert main(["plan", "--model", str(folder), "--world-size", "4", "--height", "64",
                 "--width", "96", "--num-frames", "13", "--text-tokens", "8", "--wide"]) == 0
    assert capsys.readouterr().out.splitlines()[3].count(" | ") + 1 == 17
