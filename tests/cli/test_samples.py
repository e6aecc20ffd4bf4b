"""``headmoe generate --samples FILE`` (issue 29 point 5): every line admitted before any
rank starts, a bad line named by its number and field, and one model load whose outputs
are the bytes of single ``generate`` runs."""

import json

import pytest

import headmoe.cli.generate as generate_cli
import headmoe.pipeline.job as job_module
from headmoe.cli.main import main

A = {"prompt": "a red fox running through snow", "seed": 5, "num_inference_steps": 2}
B = {"prompt": "waves at night", "seed": 6, "num_inference_steps": 2,
     "negative_prompt": "blur", "guidance_scale": 4.0}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("line3, expected", [
    ({"prompt": "x", "num_frames": 14}, "--samples line 3: num_frames=14 must be of the form "
                                        "4k+1"),
    ({"prompt": "x", "height": 2048, "width": 2048, "num_frames": 201},
     "--samples line 3: --model tiny (config tiny): height=2048, width=2048, num_frames=201 "
     "need an estimated"),
    ({"prompt": "x", "steps": 3}, "--samples line 3: unknown field steps=3"),
    ({"prompt": "x", "dtype": "bf16"}, "--samples line 3: dtype='bf16': dtype is the "
                                       "command's (--dtype)"),
    ({"prompt": "x", "output": "{out}.1.mp4"}, "--samples line 3: output "),
    ('{"prompt": "x",', "--samples line 3: not a JSON object"),
    ({"seed": 1}, "--samples line 3: prompt is required"),
])
def test_a_bad_line_3_is_refused_before_any_run(tmp_path, cache, capsys, monkeypatch,
                                                line3, expected):
    ran = []
    monkeypatch.setattr(generate_cli, "_run_jobs", lambda *a: ran.append(a) or [])
    out = tmp_path / "out.mp4"
    if isinstance(line3, dict) and "output" in line3:
        line3 = {**line3, "output": str(tmp_path / "out.1.mp4")}  # line 1's file
    samples = _write(tmp_path / "s.jsonl", [A, B, line3])
    code = main(["generate", "--samples", str(samples), "--cache-dir", str(cache),
                 "--output", str(out), "--max-memory-gib", "4"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err, err
    assert len([x for x in err.splitlines() if "error" in x]) == 1, err
    assert not ran and not list(tmp_path.glob("out*"))  # nothing started, nothing written


def _single(tmp, cache, request):
    out = tmp / "single.mp4"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in request.items()]
    assert main(["generate", *flags, "--cache-dir", str(cache), "--output", str(out),
                 "--no-progress", "--overwrite"]) == 0
    side = json.loads(out.with_suffix(".json").read_text())
    return side["video_sha256"], side["audio_sha256"], out.read_bytes()


def test_two_lines_give_the_bytes_of_two_single_runs(tmp_path, cache, monkeypatch):
    singles = [_single(tmp_path, cache, r) for r in (A, B)]
    loads = []
    build = job_module.build_components
    monkeypatch.setattr(job_module, "build_components",
                        lambda *a: loads.append(1) or build(*a))
    mine = tmp_path / "b-here.mp4"
    samples = _write(tmp_path / "s.jsonl", [A, "", {**B, "output": str(mine)}])
    assert main(["generate", "--samples", str(samples), "--cache-dir", str(cache),
                 "--output", str(tmp_path / "out.mp4"), "--no-progress"]) == 0
    assert loads == [1]  # one model load for both lines
    for mp4, (video, audio, data) in zip((tmp_path / "out.1.mp4", mine), singles, strict=True):
        side = json.loads(mp4.with_suffix(".json").read_text())
        assert (side["video_sha256"], side["audio_sha256"]) == (video, audio)
        assert mp4.read_bytes() == data
    assert not (tmp_path / "out.3.mp4").exists()
