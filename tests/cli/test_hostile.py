"""Hostile input (issue 13): every case ends in exit 2 (bad input) or 1 (fault), exactly one
``headmoe: error: ...`` line naming the file/flag/value, and no output file. Most cases fail
before any rank starts, in the launching process (`main` in-process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import headmoe.pipeline.job as job_mod
from headmoe.cli.main import main
from headmoe.release.components import resolve_model
from headmoe.testing import spawned_rank_pids

HEADMOE = str(Path(sys.executable).with_name("headmoe"))
SRC = str(Path(__file__).resolve().parents[2] / "src")


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache folder holding the tiny model's checkpoint (written once)."""
    folder = tmp_path_factory.mktemp("cache")
    resolve_model("tiny", folder)
    return folder


@pytest.fixture(scope="module")
def tiny_tensors(cache) -> dict[str, torch.Tensor]:
    _, path = resolve_model("tiny", cache, write=False)
    return load_file(path)


@pytest.fixture
def no_ranks(monkeypatch):
    """Record the job instead of running it (for cases that must pass every check)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(job_mod, "run_job", lambda ctx, job: seen.append(job) or {"output": None})
    return seen


def generate(tmp_path, cache, *flags, output=None, prompt=("--prompt", "x")):
    """Run ``headmoe generate`` in-process; returns (exit code, stderr, output path)."""
    out = Path(output) if output else tmp_path / "out" / "o.mp4"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["generate", *prompt, "--cache-dir", str(cache), "--output", str(out),
            "--no-progress", *flags]
    return main(argv), out


def assert_refused(capsys, code, out, pattern, expected_code=2):
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == expected_code, err
    assert len(lines) == 1 and lines[0].startswith("headmoe: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err
    leftovers = [p.name for p in out.parent.iterdir()] if out.parent.is_dir() else []
    assert not out.exists() and not out.with_suffix(".json").exists(), leftovers
    assert not any(n.endswith(".tmp") or n.startswith(".headmoe-probe") for n in leftovers)
    return lines[0]


def write_checkpoint(folder: Path, tensors, name="model.safetensors", config="tiny") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    save_file(tensors, str(path))
    if config:
        from headmoe.models.magi2 import get_config

        (folder / "config.json").write_text(json.dumps(get_config(config).to_dict()))
    return path


# ---------------------------------------------------------------------- flags and values
@pytest.mark.parametrize("frames, pattern", [(14, r"4k\+1.*use 13 or 17"),
                                             (4, r"4k\+1.*use 1 or 5"),
                                             (0, r"an integer in \[1, 1001\]")])
def test_num_frames_not_4k_plus_1(frames, pattern, tmp_path, cache, capsys):
    code, out = generate(tmp_path, cache, "--num-frames", str(frames))
    assert_refused(capsys, code, out, rf"--num-frames={frames} .*{pattern}, see")


@pytest.mark.parametrize("seed, flags, pattern", [
    (2**63, [], r"must be an integer in \[0, 2\*\*63 - 1\]"),
    (2**64, [], r"must be an integer in \[0, 2\*\*63 - 1\]"),
    (-1, [], r"must be an integer in \[0, 2\*\*63 - 1\]"),
    (2**63 - 1, ["--data-parallel-size", "2", "--nproc", "2"],
     r"is above 9223372036854775806: data-parallel group k uses seed \+ k")])
def test_seed_out_of_range(seed, flags, pattern, tmp_path, cache, capsys):
    code, out = generate(tmp_path, cache, "--seed", str(seed), *flags)
    assert_refused(capsys, code, out, rf"--seed={seed} {pattern}")


def test_prompt_with_invalid_utf8_from_argv(tmp_path, cache, capsys):
    code, out = generate(tmp_path, cache, prompt=("--prompt", "fox \udcff"))
    assert_refused(capsys, code, out, r"--prompt is not valid UTF-8, byte 4")
    code, out = generate(tmp_path, cache, "--negative-prompt", "\udce9")
    assert_refused(capsys, code, out, r"--negative-prompt is not valid UTF-8")


@pytest.mark.parametrize("content, pattern", [
    (b"caf\xe9", r"--prompt-file '.*p\.txt' is not valid UTF-8 \(byte 3\)"),
    (None, r"--prompt-file '.*p\.txt' cannot be read"),
])
def test_prompt_file_refused(content, pattern, tmp_path, cache, capsys):
    path = tmp_path / "p.txt"
    if content is not None:
        path.write_bytes(content)
    code, out = generate(tmp_path, cache, prompt=("--prompt-file", str(path)))
    assert_refused(capsys, code, out, pattern)


@pytest.mark.parametrize("prompt, pattern", [
    ((), r"one of the arguments --prompt --prompt-file --samples is required"),
    (("--prompt", "x", "--prompt-file", "p.txt"), r"--prompt-file: not allowed with argument --prompt"),
    (("--prompt",), r"argument --prompt: expected one argument"),
])
def test_exactly_one_prompt_source(prompt, pattern, tmp_path, cache, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate(tmp_path, cache, prompt=prompt)
    assert_refused(capsys, exit_info.value.code, tmp_path / "out" / "o.mp4",
                   pattern + r", see 'headmoe generate --help'$")


@pytest.mark.parametrize("source", ["/dev/zero", "big"])
def test_prompt_file_size_is_capped(source, tmp_path, cache, capsys):
    """`--prompt-file /dev/zero` and a 50 MB file are refused after reading at most the cap
    (4 bytes per character of the 100,000-character limit), not read whole."""
    path = source
    if source == "big":
        path = tmp_path / "big.txt"
        with open(path, "wb") as f:
            f.truncate(50 << 20)  # sparse: 50 MB of NUL bytes
    code, out = generate(tmp_path, cache, prompt=("--prompt-file", str(path)))
    assert_refused(capsys, code, out, r"--prompt-file '.*' is over 400,000 bytes \(a prompt "
                                      r"may have 100,000 characters\)")


def test_prompt_over_the_character_limit(tmp_path, cache, capsys):
    (tmp_path / "p.txt").write_text("é" * 100_001, encoding="utf-8")
    code, out = generate(tmp_path, cache, prompt=("--prompt-file", str(tmp_path / "p.txt")))
    assert_refused(capsys, code, out, r"prompt has 100,001 characters, more than the limit of "
                                      r"100,000")


def test_long_prompt_file_is_read_whole(tmp_path, cache, no_ranks):
    text = "a red fox running through deep snow at dusk, " * 40
    (tmp_path / "p.txt").write_text(text + "\n", encoding="utf-8")
    code, _ = generate(tmp_path, cache, prompt=("--prompt-file", str(tmp_path / "p.txt")))
    assert code == 0 and no_ranks[0].request.prompt == text


# ---------------------------------------------------------------------- output path
def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # permission bits do not stop root; /proc takes no new files
        return Path("/proc")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_output_folder_missing_or_unwritable(tmp_path, cache, capsys):
    out = tmp_path / "nowhere" / "o.mp4"
    code = main(["generate", "--prompt", "x", "--cache-dir", str(cache), "--output", str(out)])
    assert_refused(capsys, code, out, r"folder '.*nowhere' does not exist")
    out = _unwritable(tmp_path) / "o.mp4"
    code = main(["generate", "--prompt", "x", "--cache-dir", str(cache), "--output", str(out)])
    assert_refused(capsys, code, out, r"folder '.*' is not writable")


def test_output_is_a_folder(tmp_path, cache, capsys):
    out = tmp_path / "out" / "o.mp4"
    out.mkdir(parents=True)
    code, _ = generate(tmp_path, cache, output=out)
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"^headmoe: error: .*'.*o\.mp4' is a folder", err), err


def test_existing_output_needs_overwrite(tmp_path, cache, capsys, no_ranks):
    out = tmp_path / "out" / "o.mp4"
    out.parent.mkdir()
    out.write_bytes(b"old")
    code, _ = generate(tmp_path, cache, output=out)
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"'.*o\.mp4' already exists, pass --overwrite", err), err
    assert out.read_bytes() == b"old" and not no_ranks
    sidecar = tmp_path / "out" / "p.json"
    sidecar.write_text("{}")
    code, _ = generate(tmp_path, cache, output=tmp_path / "out" / "p.mp4")
    assert code == 2 and "p.json' already exists" in capsys.readouterr().err
    code, _ = generate(tmp_path, cache, "--overwrite", output=out)
    assert code == 0 and len(no_ranks) == 1


# ---------------------------------------------------------------------- memory estimate
def test_huge_request_refused_by_the_memory_estimate(tmp_path, cache, capsys):
    code, out = generate(tmp_path, cache, "--num-frames", "1001", "--height", "4096",
                         "--width", "4096")
    line = assert_refused(capsys, code, out, r"need an estimated [\d.]+ GiB per rank \(weights")
    assert re.search(r"more than the [\d.]+ GiB limit \(available host memory", line)
    assert "--max-memory-gib" in line


def test_max_memory_gib_overrides_the_limit(tmp_path, cache, capsys, no_ranks):
    code, out = generate(tmp_path, cache, "--max-memory-gib", "0.01")
    assert_refused(capsys, code, out, r"more than the 0\.01 GiB limit \(--max-memory-gib\)")
    code, _ = generate(tmp_path, cache, "--max-memory-gib", "1000")
    assert code == 0 and len(no_ranks) == 1


def test_mismatched_big_config_refused_before_any_weight(tmp_path, cache, capsys):
    _, ckpt = resolve_model("tiny", cache, write=False)
    code, out = generate(tmp_path, cache, "--model", ckpt, "--model-config", "magi2-preview")
    assert_refused(capsys, code, out, r"config magi2-preview\): .* need an estimated [\d.]+ GiB")


# ---------------------------------------------------------------------- checkpoints and configs
def _model_flags(path: Path) -> tuple[str, ...]:
    return ("--model", str(path))


def test_nan_weight_refused_by_check_weights(tmp_path, cache, tiny_tensors, capsys):
    bad = dict(tiny_tensors)
    name = next(n for n in bad if "final_linear_video" in n)
    bad[name] = bad[name].clone()
    bad[name].view(-1)[3] = float("nan")
    path = write_checkpoint(tmp_path / "ck", bad)
    code, out = generate(tmp_path, cache, *_model_flags(path), "--check-weights")
    assert_refused(capsys, code, out, rf"non-finite values in 1 tensor\(s\): {re.escape(name)} \(NaN")


@pytest.mark.parametrize("dtype, pattern", [(torch.int32, r"non-float dtype.*I32"),
                                            (torch.bool, r"non-float dtype.*BOOL")])
def test_integer_or_bool_tensor_refused(dtype, pattern, tmp_path, cache, tiny_tensors, capsys):
    bad = dict(tiny_tensors)
    name = next(n for n in bad if n.endswith("final_linear_audio.weight"))
    bad[name] = bad[name].to(dtype)
    path = write_checkpoint(tmp_path / "ck", bad)
    code, out = generate(tmp_path, cache, *_model_flags(path))
    assert_refused(capsys, code, out, rf"checkpoint '.*model\.safetensors'.*{pattern}")


def test_other_float_dtype_converted_and_said_so(tmp_path, cache, tiny_tensors, capsys, no_ranks):
    conv = dict(tiny_tensors)
    name = next(n for n in conv if n.endswith("final_linear_audio.weight"))
    conv[name] = conv[name].to(torch.float16)
    path = write_checkpoint(tmp_path / "ck", conv)
    code, _ = generate(tmp_path, cache, *_model_flags(path))
    err = capsys.readouterr().err
    assert code == 0 and len(no_ranks) == 1, err
    assert re.search(rf"note: 1 checkpoint tensor\(s\) .* converted .*{re.escape(name)}: F16", err)


def test_truncated_safetensors_named(tmp_path, cache, tiny_tensors, capsys):
    path = write_checkpoint(tmp_path / "ck", tiny_tensors)
    path.write_bytes(path.read_bytes()[:1000])
    code, out = generate(tmp_path, cache, *_model_flags(path))
    assert_refused(capsys, code, out, r"'.*model\.safetensors' is not a readable safetensors")


@pytest.mark.parametrize("index, pattern", [
    ("{not json", r"index '.*m\.safetensors\.index\.json' is not a readable JSON"),
    ({"weight_map": {"a": 3}}, r"needs a 'weight_map' object of strings"),
    ({"weight_map": {"a": "../other.safetensors"}}, r"shard file '\.\./other\.safetensors' is "
                                                    r"outside the folder '.*/ck'"),
    ({"weight_map": {"a": "/etc/passwd"}}, r"shard file '/etc/passwd' is not a relative file"),
    ({"weight_map": {"a": "link.safetensors"}}, r"shard file 'link\.safetensors' is a link to "
                                                r"'.*x\.safetensors', outside the folder"),
    ({"weight_map": {"a": "gone.safetensors"}}, r"shard file '.*gone\.safetensors' is missing"),
])
def test_bad_index_files(index, pattern, tmp_path, cache, capsys):
    folder = tmp_path / "ck"
    write_checkpoint(tmp_path / "other_dir", {"a": torch.zeros(1)}, "x.safetensors", None)
    write_checkpoint(folder, {"a": torch.zeros(1)}, "unused.safetensors")
    (folder.parent / "other.safetensors").write_bytes(b"")
    (folder / "link.safetensors").symlink_to(tmp_path / "other_dir" / "x.safetensors")
    path = folder / "m.safetensors.index.json"
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    code, out = generate(tmp_path, cache, *_model_flags(path))
    assert_refused(capsys, code, out, pattern)


@pytest.mark.parametrize("config, pattern", [
    ("{oops", r"config\.json"),
    ("UNKNOWN", r"config\.json.*not_a_key"),
])
def test_bad_config_files(config, pattern, tmp_path, cache, tiny_tensors, capsys):
    from headmoe.models.magi2 import get_config

    path = write_checkpoint(tmp_path / "ck", {"a": torch.zeros(1)}, config=None)
    if config == "UNKNOWN":
        config = json.dumps({**get_config("tiny").to_dict(), "not_a_key": 1})
    (path.parent / "config.json").write_text(config)
    code, out = generate(tmp_path, cache, *_model_flags(path))
    assert_refused(capsys, code, out, pattern)


# ---------------------------------------------------------------------- the boundary itself
def test_subprocess_has_one_line_and_traceback_only_with_debug(tmp_path, cache):
    env = {**os.environ, "PYTHONPATH": SRC}
    base = [HEADMOE, "generate", "--cache-dir", str(cache), "--output", str(tmp_path / "o.mp4")]
    proc = subprocess.run([*base, "--prompt", b"\xff".decode("utf-8", "surrogateescape")],
                          capture_output=True, env=env, timeout=120)
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert re.match(r"headmoe: error: --prompt is not valid UTF-8, byte 0", err[0])
    proc = subprocess.run([*base, "--num-frames", "6", "--debug", "--prompt", "x"],
                          capture_output=True, env=env, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" in err and "use 5 or 9" in err.splitlines()[-1]
    assert not (tmp_path / "o.mp4").exists()


def test_launch_failure_is_one_line_naming_the_rank(capsys):
    from headmoe.cli.errors import run_guarded
    from headmoe.distributed.launch import LaunchFailure

    def fail():
        raise LaunchFailure({0: "Traceback...\nRuntimeError: gloo timeout", 1: "tb\nx"},
                            {0: "RuntimeError: gloo timeout",
                             1: "RankUnresponsive: rank 1 stopped responding at step 3"})

    assert run_guarded(fail, "generate", False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["headmoe: error: rank 1 failed: rank 1 stopped responding at step 3 (1 more "
                   "rank(s) failed too), rerun with --debug for every rank's traceback"]

    def bad_input():
        raise LaunchFailure({2: "tb"}, {2: "ValueError: height must be a multiple of 16"})

    assert run_guarded(bad_input, "generate", False) == 2
    assert "rank 2 failed: height must be" in capsys.readouterr().err

    def killed():
        raise LaunchFailure({0: "tb", 1: "killed by signal 9"},
                            {0: "RankUnresponsive: rank 1 stopped responding",
                             1: "killed by signal 9"})

    assert run_guarded(killed, "generate", False) == 1
    assert "rank 1 failed: killed by signal 9 (1 more" in capsys.readouterr().err


def test_interrupt_and_broken_pipe(capsys):
    from headmoe.cli.errors import run_guarded

    def interrupted():
        raise KeyboardInterrupt

    assert run_guarded(interrupted, "generate", False) == 130
    assert capsys.readouterr().err.strip() == "headmoe: interrupted"


def test_broken_pipe_exits_quietly(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([HEADMOE, "plan", "--model", "tiny", "--world-size", "48", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and first.strip() == b"{" and err == "", err


# ---------------------------------------------------------------------- plan and compare
@pytest.mark.parametrize("flags, pattern", [
    (["--world-size", "0"], r"--world-size must be a positive number of ranks, at most 4,096, "
                            r"got 0, e.g. --world-size 8"),
    (["--world-size", "-2"], r"--world-size .* got -2"),
    (["--world-size", "1000000"], r"--world-size .* at most 4,096, got 1000000"),  # answers
    (["--world-size", "8", "--memory-gib", "-1"], r"--memory-gib must be a number of GiB in "
                                                  r"\[0, 1,048,576\] \(0: no limit\), got -1.0"),
    (["--world-size", "8", "--memory-gib", "nan"], r"--memory-gib .* got nan"),
    (["--world-size", "8", "--num-frames", "14"], r"--num-frames=14 must be of the form 4k\+1"),
    (["--world-size", "8", "--height", "16" + "0" * 200], r"--height=16000.* must be an "
                                                          r"integer in \[1, 4096\]"),
    (["--world-size", "8", "--text-tokens", "7001"], r"--text-tokens must be in \[1, 7000\]"),
])
def test_plan_flags_validated(flags, pattern, capsys):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"headmoe: error: " + pattern, err[0]), err


def test_plan_suggests_memory_gib_when_nothing_fits(capsys):
    assert main(["plan", "--world-size", "8", "--memory-gib", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"fits no layout .* pass --memory-gib 44 or more", err[0])


def test_plan_4096_ranks_in_seconds(capsys):

    t0 = time.perf_counter()
    assert main(["plan", "--world-size", "4096", "--json"]) == 0
    elapsed = time.perf_counter() - t0
    data = json.loads(capsys.readouterr().out)
    assert elapsed < 30, elapsed  # 109 s before DP replicas were predicted once
    assert all(len(p["moe_rows_per_rank"]) == 4096 for p in data["layouts"])
    assert sum(p["recommended"] for p in data["layouts"]) == 1


class _Recorder:
    def __init__(self):
        self.cmds = []

    def __call__(self, cmd):
        self.cmds.append(cmd)
        raise AssertionError("no layout may run")


def test_compare_validates_every_layout_before_running_any(tmp_path, capsys):
    from headmoe.cli.compare import main as compare_main

    runner = _Recorder()
    code = compare_main(["--layouts", "sp1", "sp5", "--prompt", "x", "--output-dir",
                         str(tmp_path)], runner=runner)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and runner.cmds == [] and len(err) == 1, err
    assert re.match(r"headmoe: error: --layouts 'sp5' cannot run model 'tiny': .*divisible", err[0])
    assert list(tmp_path.iterdir()) == []
    code = compare_main(["--layouts", "sp1", "--prompt", "x", "--num-frames", "6"], runner=runner)
    assert code == 2 and runner.cmds == [] and "use 5 or 9" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # generate's --output is not an abbreviation of --output-dir
        compare_main(["--layouts", "sp1", "--prompt", "x", "--output", str(tmp_path / "x.mp4")],
                     runner=runner)
    assert "unrecognized arguments: --output" in capsys.readouterr().err
    assert not (tmp_path / "x.mp4").exists() and runner.cmds == []


def test_compare_forwards_dash_values_safely(tmp_path, capsys):
    from headmoe.cli.compare import main as compare_main
    from headmoe.cli.main import build_parser

    runner = _Recorder()
    argv = ["--layouts", "sp1", "--prompt=-fox", "--negative-prompt=-blur", "--output-dir",
            str(tmp_path)]
    assert compare_main(argv, runner=runner) == 1  # the recorder's run "fails"
    (cmd,) = runner.cmds
    assert "--prompt=-fox" in cmd and "--negative-prompt=-blur" in cmd
    args = build_parser().parse_args(cmd[cmd.index("generate"):])
    assert args.prompt == "-fox" and args.negative_prompt == "-blur"
    assert "no layout may run" in capsys.readouterr().err


# ---------------------------------------------------------------------- runs that must fail
SMALL = ("--num-inference-steps", "1", "--height", "16", "--width", "16", "--num-frames", "1")


def test_nan_weight_fails_the_run_not_a_black_mp4(tmp_path, cache, tiny_tensors, capsys):
    bad = dict(tiny_tensors)
    name = next(n for n in bad if ".layers.1." in n and n.endswith(".weight"))
    bad[name] = bad[name].clone()
    bad[name].view(-1)[0] = float("nan")
    path = write_checkpoint(tmp_path / "ck", bad)
    code, out = generate(tmp_path, cache, *_model_flags(path), *SMALL)
    assert_refused(capsys, code, out, r"NaN in the predicted (video|audio) velocity of the "
                   r"conditional branch at denoising step 1/1 .*--check-weights", 1)
    code, out = generate(tmp_path, cache, *_model_flags(path), *SMALL, "--debug")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "Traceback" in "\n".join(err)
    assert re.match(r"headmoe: error: NaN first appears in the output of transformer layer 1 ",
                    err[-1]), err[-1]
    assert not out.exists()


def _read_until_step(proc: subprocess.Popen, mark: bytes) -> tuple[bytearray, threading.Thread]:
    """Collect `proc`'s stderr in a thread; return once `mark` (a progress-bar step) shows,
    the process ends, or 240 s pass."""
    err = bytearray()
    reader = threading.Thread(
        target=lambda: [err.extend(c) for c in iter(lambda: proc.stderr.read1(4096), b"")],
        daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while mark not in err and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return err, reader


@pytest.mark.multirank
def test_stopped_rank_is_named_within_the_timeout(tmp_path, cache):
    import signal

    out = tmp_path / "hung.mp4"
    timeout = 15
    cmd = [HEADMOE, "generate", "--prompt", "x", "--nproc", "2", "--ulysses-degree", "2",
           "--num-inference-steps", "50", "--cache-dir", str(cache), "--output", str(out),
           "--timeout", str(timeout)]
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    err, reader = _read_until_step(proc, b" 2/50 ")
    victims = spawned_rank_pids(proc.pid)
    assert proc.poll() is None and len(victims) == 2, err.decode(errors="replace")
    os.kill(victims[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=timeout + 90)
    finally:
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elapsed = time.monotonic() - t0
    reader.join(timeout=5)
    lines = [ln for ln in err.decode(errors="replace").splitlines() if "headmoe: error" in ln]
    assert code == 1 and len(lines) == 1, err.decode(errors="replace")[-3000:]
    # the step is rank 1's last heartbeat, which may not have reached the launcher yet
    assert re.search(r"rank 1 \((last at step \d+/50|before step 1)\) stopped responding: "
                     rf"rank 0 waited --timeout {timeout} s", lines[0]), lines[0]
    assert elapsed < timeout + 60, elapsed
    assert not out.exists() and not out.with_suffix(".json").exists()


@pytest.mark.multirank
def test_ctrl_c_stops_a_multirank_run_within_seconds(tmp_path, cache):
    import signal

    out = tmp_path / "int.mp4"
    cmd = [HEADMOE, "generate", "--prompt", "x", "--nproc", "2", "--ulysses-degree", "2",
           "--num-inference-steps", "50", "--cache-dir", str(cache), "--output", str(out)]
    env = {**os.environ, "PYTHONPATH": SRC}
    # A terminal's command starts with SIGINT at its default action. The test's own runner
    # may ignore SIGINT (a background job of a non-interactive shell does), and a process
    # started with SIGINT ignored keeps ignoring it, as Unix means it to: reset it here.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err, reader = _read_until_step(proc, b" 2/50 ")
    assert proc.poll() is None, err.decode(errors="replace")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    reader.join(timeout=5)
    text = err.decode(errors="replace")
    assert code == 130 and elapsed < 15, (code, elapsed, text[-3000:])
    assert text.strip().splitlines()[-1] == "headmoe: interrupted" and "Traceback" not in text
    assert not out.exists()


# ------------------------------------------- generate --image: bounded decoding (issue 32)
@pytest.mark.parametrize("kind", ["scans", "webp-8k"])
def test_generate_image_bombs_refused_before_decoding(kind, tmp_path, cache, capsys):
    from tests.pipeline.test_image import WEBP_8K, many_scans_jpeg

    path = tmp_path / "bomb.img"
    path.write_bytes(many_scans_jpeg(5000) if kind == "scans" else WEBP_8K)
    start = time.monotonic()
    code, out = generate(tmp_path, cache, "--image", str(path))
    assert time.monotonic() - start < 30  # the check, not a decode (the tiny load included)
    pattern = "5000 scans, more than the 100" if kind == "scans" else "needs about 768 MiB"
    assert_refused(capsys, code, out, pattern)
