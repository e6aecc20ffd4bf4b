"""The layout contract in FP8 (issue 28 point 5): `headmoe generate --expert-format fp8` on
the tiny release gives the same video and audio bytes on 1 rank, SP4+EP2 with both
``--moe-exchange`` values and SP2xCFG2, and they differ from bf16's (the flag took effect);
``headmoe quantize``'s folder gives the same bytes (streamed from it with
``--offload-layers``, on SP2), and the refusals. One module-scoped set of launches, run two at a
time after the tiny release and the FP8 folder exist."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serve.server import HEADMOE

PROMPT = "a red fox running through snow at dusk"
STEPS = "1"
SP4_EP2 = ["--nproc", "4", "--ulysses-degree", "4", "--enable-expert-parallel",
           "--expert-parallel-size", "2"]
#: name -> generate flags of each launch; "qdir" stands for the quantized folder
RUNS = {
    "fp8 1 rank": ["--expert-format", "fp8"],
    "fp8 sp4 ep2 ep_group": [*SP4_EP2, "--moe-exchange", "ep_group", "--expert-format", "fp8"],
    "fp8 sp4 ep2 sp_group": [*SP4_EP2, "--moe-exchange", "sp_group", "--expert-format", "fp8"],
    "fp8 sp2 cfg2": ["--nproc", "4", "--ulysses-degree", "2", "--cfg-parallel-size", "2",
                     "--expert-format", "fp8"],
    "bf16 1 rank": [],
}
#: the launch from the `headmoe quantize` folder (its own test: each test's setup stays
#: within the per-test timeout on a loaded 2-core machine)
QUANTIZED = ["--model", "qdir", "--nproc", "2", "--ulysses-degree", "2", "--offload-layers"]

pytestmark = pytest.mark.multirank


def _headmoe(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HEADMOE, *args], capture_output=True, text=True, timeout=timeout)


def _generate(tmp: Path, cache: Path, qdir: Path | None, name: str, flags: list[str]) -> dict:
    out = tmp / f"{name.replace(' ', '_')}.mp4"
    flags = [str(qdir) if f == "qdir" and qdir is not None else f for f in flags]
    proc = _headmoe("generate", "--prompt", PROMPT, "--num-inference-steps", STEPS,
                    "--cache-dir", str(cache), "--output", str(out), "--no-progress", *flags)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def tmp_cache(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    return tmp, tmp / "cache"


@pytest.fixture(scope="module")
def folders(tmp_cache):
    """(tmp, cache, the tiny release quantized by `headmoe quantize`)."""
    tmp, cache = tmp_cache
    qdir = tmp / "tiny-fp8"
    proc = _headmoe("quantize", "--model", "tiny", "--cache-dir", str(cache), "--output",
                    str(qdir))
    assert proc.returncode == 0, proc.stderr
    assert "headmoe: quantize: preview/:" in proc.stderr  # progress lines
    return tmp, cache, qdir


@pytest.fixture(scope="module")
def sides(tmp_cache):
    tmp, cache = tmp_cache
    first, *rest = RUNS.items()
    out = {first[0]: _generate(tmp, cache, None, *first)}  # writes the tiny release once
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(_generate, tmp, cache, None, name, flags)
                for name, flags in rest}
        return out | {name: run.result() for name, run in runs.items()}


def test_every_layout_gives_the_same_fp8_bytes_and_they_differ_from_bf16(sides):
    hashes = {name: (s["video_sha256"], s["audio_sha256"]) for name, s in sides.items()}
    bf16 = hashes.pop("bf16 1 rank")
    assert len(set(hashes.values())) == 1, hashes
    fp8 = hashes["fp8 1 rank"]
    assert fp8[0] != bf16[0] and fp8[1] != bf16[1], (fp8, bf16)
    assert {s["model"]["expert_format"] for n, s in sides.items() if n != "bf16 1 rank"} == {
        "fp8"}
    assert sides["bf16 1 rank"]["model"]["expert_format"] == "bf16"
    assert sides["fp8 sp4 ep2 sp_group"]["layout"]["resolved_expert_parallel_size"] == 2


def test_quantized_folder_gives_the_bytes_of_quantize_on_load(sides, folders):
    tmp, cache, qdir = folders
    side = _generate(tmp, cache, qdir, "quantized sp2 streamed", QUANTIZED)
    assert (side["video_sha256"], side["audio_sha256"]) == (
        sides["fp8 1 rank"]["video_sha256"], sides["fp8 1 rank"]["audio_sha256"])
    assert side["model"]["expert_format"] == "fp8" and side["layout"]["offload_layers"]


def test_quantized_folder_layout_and_headers(folders):
    _, _, qdir = folders
    index = json.loads(next((qdir / "preview").glob("*.index.json")).read_text())
    names = index["weight_map"]
    scales = [n for n in names if n.endswith(".moe_mlp.W_gate_scale")]
    assert scales and all(n.removesuffix("_scale") in names for n in scales)
    assert index["metadata"]["expert_format"] == "fp8-e4m3"
    for part in ("text_encoder", "turbo_vae", "stable-audio-open-1.0", "refiner"):
        assert (qdir / part).is_dir(), part
    assert not any(p.is_symlink() for p in qdir.rglob("*"))
    assert not list(qdir.parent.glob(".tiny-fp8*"))  # no temp folder left


def test_refusals(folders, tmp_path, capsys):
    """In this process (no launch): the contradictions name both flags, quantize refuses a
    non-empty output, an FP8 source and a link out of the source folder."""
    from headmoe.cli.main import main
    from headmoe.errors import UserError
    from headmoe.release.quantize import quantize_release

    tmp, cache, qdir = folders
    base = ["generate", "--prompt", "x", "--cache-dir", str(cache), "--output",
            str(tmp_path / "x.mp4")]
    assert main([*base, "--model", str(qdir), "--expert-format", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "--expert-format='bf16' contradicts the checkpoint" in err and "fp8-e4m3" in err
    assert main([*base, "--offload-layers", "--expert-format", "fp8"]) == 2
    assert "--offload-layers streams the checkpoint's stored bytes" in capsys.readouterr().err
    (tiny,) = list(cache.glob("tiny-release-*"))
    with pytest.raises(UserError, match="exists and is not an empty folder"):
        quantize_release(tiny, qdir)
    with pytest.raises(UserError, match="already stores fp8 experts"):
        quantize_release(qdir, tmp_path / "again")
    linked = tmp_path / "linked"
    for src in tiny.rglob("*"):  # a copy of the bf16 release (hard links) with a link out
        dst = linked / src.relative_to(tiny)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    os.symlink("/etc/hostname", linked / "vae" / "extra.txt")
    with pytest.raises(UserError, match=r"vae/extra.txt \(a link to"):
        quantize_release(linked, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))  # nor its temp folder
