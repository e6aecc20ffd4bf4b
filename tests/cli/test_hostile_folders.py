"""Hostile release folders (issue 23 points 1, 2, 5, 11, 12): a folder is data, never code
and never a way out. Each case ends in exit 2 and one ``headmoe: error:`` line naming the
file, before any rank starts and before any skeleton of the folder's sizes is built; the
Hugging Face cache layout (snapshot files linking into ``../../blobs/``) is accepted.

Every test works on a hard-linked copy of the embedded tiny release (files are replaced,
never written into) and stops at the launch (`launch_local` records instead of starting)."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import headmoe.cli.generate as generate_cli
import headmoe.models.magi2.loading as loading
from headmoe.cli.main import main
from headmoe.files import MAX_LISTED
from headmoe.release import folder as release

LAYOUT = ["--nproc", "2", "--ulysses-degree", "2"]
REQUEST = ["--height", "32", "--width", "48", "--num-frames", "5", "--num-inference-steps", "2",
           "--prompt", "a fox", "--no-progress"]
TE = release.TEXT_ENCODER_DIR


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_release_in) -> Path:
    return tiny_release_in(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def copy(folder, tmp_path) -> Path:
    dst = tmp_path / "rel"
    shutil.copytree(folder, dst, copy_function=os.link)
    return dst


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Record launches instead of starting ranks; a prompt on the terminal fails the test;
    a case that blocks fails after 60 s instead of hanging the suite."""
    launched: list = []
    monkeypatch.setattr(generate_cli, "launch_local", lambda *a, **k: launched.append(a) or [])

    def no_prompt(*a, **k):
        raise AssertionError(f"asked on the terminal: {a}")

    monkeypatch.setattr(builtins, "input", no_prompt)

    def hung(*a):
        raise TimeoutError("blocked for 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield launched
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def run(model: Path, tmp_path: Path, *flags: str) -> tuple[int, Path]:
    out = tmp_path / "o.mp4"
    return main(["generate", "--model", str(model), "--output", str(out), *LAYOUT, *REQUEST,
                 *flags]), out


def refused(capsys, code: int, out: Path, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("headmoe: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not out.exists(), err
    for needle in needles:
        assert needle in err, err
    return err


def rewrite_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.unlink()  # break the hard link
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------------- point 1: no code
EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def test_auto_map_is_never_run_nor_asked_about(copy, tmp_path, capsys, no_launch):
    marker = tmp_path / "code-ran"
    for name in ("evil_config.py", "evil_tokenizer.py"):
        (copy / TE / name).write_text(EVIL.format(marker=str(marker)))
    rewrite_json(copy / TE / "config.json", lambda d: d.update(
        auto_map={"AutoConfig": "evil_config.EvilConfig", "AutoModel": "evil_config.Evil"}))
    rewrite_json(copy / TE / "tokenizer_config.json", lambda d: d.update(
        auto_map={"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}))
    code, _ = run(copy, tmp_path)
    assert code == 0 and len(no_launch) == 1, capsys.readouterr().err
    assert not marker.exists()


def test_unknown_model_type_with_auto_map_refused(copy, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    (copy / TE / "evil.py").write_text(EVIL.format(marker=str(marker)))
    rewrite_json(copy / TE / "config.json", lambda d: d.update(
        model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"}))
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, "model_type='evil'", "config.json")
    assert not marker.exists()


# ---------------------------------------------------------------------- point 2: containment
def _text_index(copy: Path, shard_for) -> None:
    """Replace the text encoder's single file by an index whose entries ``shard_for(name)``
    gives (the real tensors stay reachable as ``inside.safetensors``)."""
    single = copy / TE / "model.safetensors"
    names = list(load_file(single))
    single.rename(copy / TE / "inside.safetensors")
    (copy / TE / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: shard_for(n) for n in names}}))


@pytest.mark.parametrize("case", ["dotdot", "absolute", "outside-valid", "symlink-out", "fifo"])
def test_text_encoder_index_stays_in_its_folder(case, copy, tmp_path, capsys):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(copy / TE / "model.safetensors", outside)
    if case == "symlink-out":
        os.symlink(outside, copy / TE / "link.safetensors")
    if case == "fifo":
        os.mkfifo(copy / TE / "pipe.safetensors")
    entry = {"dotdot": "../../../../../../etc/passwd", "absolute": str(outside),
             "outside-valid": "../../outside.safetensors", "symlink-out": "link.safetensors",
             "fifo": "pipe.safetensors"}[case]
    _text_index(copy, lambda n: entry)
    code, out = run(copy, tmp_path)
    why = {"dotdot": "outside the folder", "absolute": "not a relative file name",
           "outside-valid": "outside the folder", "symlink-out": "a link to",
           "fifo": "not a regular file"}[case]
    named = "text_encoder" if case in ("symlink-out", "fifo") else "model.safetensors.index.json"
    refused(capsys, code, out, named, repr(entry), why)


def test_fifo_the_tokenizer_would_read_is_refused_without_blocking(copy, tmp_path, capsys):
    os.mkfifo(copy / TE / "special_tokens_map.json")
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, "'special_tokens_map.json' is not a regular file")


@pytest.mark.parametrize("rel", [f"{TE}/tokenizer.json", f"{release.PREVIEW_DIR}/config.json"])
def test_release_file_linked_out_or_fifo(rel, copy, tmp_path, capsys):
    (copy / rel).unlink()
    os.symlink("/etc/hostname", copy / rel)
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, f"{rel} (a link to '/etc/hostname', outside the folder")
    (copy / rel).unlink()
    os.mkfifo(copy / rel)
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, f"{rel} (not a regular file)")


# ---------------------------------------------------------------------- point 12: HF cache
def hf_cache(folder: Path, root: Path) -> Path:
    """``folder`` in the Hugging Face cache layout: every file of
    ``models--org--name/snapshots/<rev>/`` a relative link into ``../../blobs/``."""
    repo = root / "models--sand-ai--MAGI-2-preview"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    for i, src in enumerate(sorted(p for p in folder.rglob("*") if p.is_file())):
        rel = src.relative_to(folder)
        blob = repo / "blobs" / f"{i:064x}"
        os.link(src, blob)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


def test_hugging_face_cache_layout_accepted(folder, tmp_path, capsys, no_launch):
    snap = hf_cache(folder, tmp_path / "hub")
    assert (snap / release.PREVIEW_DIR / "config.json").is_symlink()
    code, _ = run(snap, tmp_path)
    assert code == 0 and len(no_launch) == 1, capsys.readouterr().err


def test_hugging_face_cache_still_refuses_entries_out_of_the_folder(folder, tmp_path, capsys):
    snap = hf_cache(folder, tmp_path / "hub")
    index = snap / release.PREVIEW_DIR / release.TRANSFORMER_INDEX
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    blob = os.readlink(snap / release.PREVIEW_DIR / first)  # ../../../blobs/<hash>
    data["weight_map"] = {n: blob if f == first else f for n, f in data["weight_map"].items()}
    index.unlink()
    index.write_text(json.dumps(data))
    code, out = run(snap, tmp_path)
    refused(capsys, code, out, f"{blob!r} is outside the folder")
    other = tmp_path / "hub" / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    shutil.copy(snap / release.PREVIEW_DIR / first, other / "x")
    (snap / release.PREVIEW_DIR / first).unlink()
    os.symlink(other / "x", snap / release.PREVIEW_DIR / first)
    data["weight_map"] = {n: first if f == blob else f for n, f in data["weight_map"].items()}
    index.unlink()
    index.write_text(json.dumps(data))
    code, out = run(snap, tmp_path)
    refused(capsys, code, out, "a link to", "outside the folder")


# ---------------------------------------------------------------------- point 5: huge configs
def test_million_layer_transformer_config_refused_before_its_skeleton(copy, tmp_path, capsys,
                                                                      monkeypatch):
    def change(d):
        d["num_layers"] = 1_000_000
        d["moe"]["layers"] = [i for i in range(1_000_000) if i not in d["multimodal_layers"]]

    rewrite_json(copy / release.PREVIEW_DIR / "config.json", change)
    built = loading.checkpoint_spec
    monkeypatch.setattr(loading, "checkpoint_spec", lambda cfg: built(cfg) if cfg.num_layers
                        < 1000 else pytest.fail("built a 1,000,000-layer skeleton"))
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, "holds 6 transformer layers", "num_layers=1000000")


REFINED = ("--refiner-height", "64", "--refiner-width", "96", "--refiner-steps", "1")


def refiner_refused(capsys, code: int, out: Path, *needles: str) -> None:
    """`refused`, past the copy's note on the entries it does not use (printed before)."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if " component entries headmoe does not use" not in ln]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("headmoe: error: "), err
    assert "Traceback" not in err and not out.exists(), err
    for needle in needles:
        assert needle in lines[0], err


def refiner_unused(capsys, code: int, launched: list, *needles: str) -> str:
    """A run without the refiner stage went on, with one warning naming the problem."""
    err = capsys.readouterr().err
    assert code == 0 and launched, err
    warnings = [ln for ln in err.splitlines() if "refiner/ is not used" in ln]
    assert len(warnings) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in warnings[0], err
    return warnings[0]


def test_million_layer_refiner_config_refused_before_its_skeleton(copy, tmp_path, capsys,
                                                                  monkeypatch, no_launch):
    """Issue 32 points 5 and 6: the preview's layer-count check (`read_headers`) runs for
    the refiner too, before its skeleton, at once; a run that does not use the refiner goes
    on with one warning, a run of the refiner stage is refused with one line."""
    import headmoe.models.refiner.loading as refiner_loading

    rewrite_json(copy / release.REFINER_DIR / "config.json",
                 lambda d: d.update(num_layers=1_000_000))
    built = refiner_loading.refiner_spec
    monkeypatch.setattr(refiner_loading, "refiner_spec", lambda cfg: built(cfg) if
                        cfg.num_layers < 1000 else pytest.fail("built a 1,000,000-layer refiner"))
    start = time.monotonic()
    code, _ = run(copy, tmp_path)
    refiner_unused(capsys, code, no_launch, "holds 4 transformer layers", "refiner config",
                   "num_layers=1000000")
    code, out = run(copy, tmp_path, *REFINED)
    refiner_refused(capsys, code, out, "--refiner-height=64 needs the refiner stage",
                    "failed its checks", "holds 4 transformer layers")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("case", ["fifo", "dev-zero", "folder", "linked-out"])
def test_refiner_entries_held_to_the_folder_rule(case, copy, tmp_path, capsys, no_launch):
    """Issue 32 point 8: refiner/config.json that is a FIFO, /dev/zero or a folder, or a
    refiner/ linked out of the release, is refused like preview/'s entries (never the
    preset in its place): the run without the refiner warns, the refiner stage is refused."""
    cfg = copy / release.REFINER_DIR / "config.json"
    if case == "linked-out":
        outside = tmp_path / "elsewhere"
        shutil.copytree(copy / release.REFINER_DIR, outside)
        shutil.rmtree(copy / release.REFINER_DIR)
        (copy / release.REFINER_DIR).symlink_to(outside)
        needle = "outside the folder"
    else:
        cfg.unlink()
        {"fifo": lambda: os.mkfifo(cfg), "dev-zero": lambda: cfg.symlink_to("/dev/zero"),
         "folder": lambda: cfg.mkdir()}[case]()
        needle = "a link to '/dev/zero'" if case == "dev-zero" else "not a regular file"
    refiner_unused(capsys, run(copy, tmp_path)[0], no_launch, needle)
    code, out = run(copy, tmp_path, *REFINED)
    refiner_refused(capsys, code, out, "needs the refiner stage", needle)


@pytest.mark.parametrize("component", ["refiner", "vae"])
def test_check_weights_reads_the_refiner_and_the_image_encoder(component, copy, tmp_path,
                                                               capsys):
    """Issue 32 point 7: --check-weights reads refiner/ and (with --image) vae/ too, and
    names the file holding the NaN."""
    import torch

    if component == "refiner":
        path = copy / release.REFINER_DIR / "model.safetensors"
        tensors = load_file(path)
        name = next(n for n, t in tensors.items() if t.is_floating_point())
        tensors[name] = tensors[name].clone().view(-1).index_fill(0, torch.tensor([0]),
                                                                  float("nan")).view_as(
            tensors[name])
        path.unlink()
        save_file(tensors, path)
        flags: tuple[str, ...] = ()
    else:
        path = copy / "vae" / "Wan2.2_VAE.pth"
        state = torch.load(path, weights_only=True)
        key = next(k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point())
        state[key] = torch.full_like(state[key], float("nan"))
        path.unlink()
        torch.save(state, path)
        image = tmp_path / "i.png"
        from PIL import Image

        Image.new("RGB", (40, 24), (9, 99, 199)).save(image)
        flags = ("--image", str(image))
    code, out = run(copy, tmp_path, "--check-weights", *flags)
    refiner_refused(capsys, code, out, "non-finite", f"{path.parent.name}/{path.name}")


def test_missing_refiner_config_says_the_preset_was_assumed(copy, tmp_path, capsys):
    (copy / release.REFINER_DIR / "config.json").unlink()
    code, out = run(copy, tmp_path, *REFINED)
    refiner_refused(capsys, code, out, "refiner/config.json is absent: the magi2-refiner "
                                       "preset is assumed")


@pytest.mark.parametrize("rel", [f"{release.REFINER_DIR}/config.json",
                                 f"{release.PREVIEW_DIR}/config.json"])
def test_deeply_nested_config_is_one_line(rel, copy, tmp_path, capsys):
    """Issue 32 point 10: a config nested 100,000 deep is named, not a RecursionError."""
    path = copy / rel
    path.unlink()
    path.write_text('{"num_layers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    if rel.startswith(release.REFINER_DIR):  # only the refiner stage needs it (point 6)
        code, out = run(copy, tmp_path, *REFINED)
        refiner_refused(capsys, code, out, "config.json", "nested too deeply")
    else:
        code, out = run(copy, tmp_path)
        refused(capsys, code, out, "config.json", "nested too deeply")


def test_million_layer_text_encoder_config_refused_before_its_skeleton(copy, tmp_path, capsys,
                                                                       monkeypatch):
    import transformers

    rewrite_json(copy / TE / "config.json", lambda d: d.update(
        num_hidden_layers=1_000_000, layer_types=None))
    real = transformers.Qwen3_5TextModel

    def guarded(cfg):
        assert cfg.num_hidden_layers < 1000, "built a 1,000,000-layer skeleton"
        return real(cfg)

    monkeypatch.setattr(transformers, "Qwen3_5TextModel", guarded)
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, "num_hidden_layers=1000000 but the weights hold 5 layers")


def test_moe_layers_mismatch_message_stays_short(copy, tmp_path, capsys):
    rewrite_json(copy / release.PREVIEW_DIR / "config.json",
                 lambda d: d.update(num_layers=1_000_000))
    code, out = run(copy, tmp_path)
    err = refused(capsys, code, out, "(999996 items)")
    assert len(err) < 2000


# ---------------------------------------------------------------------- point 11: messages
@pytest.mark.parametrize("rel", [f"{TE}/tokenizer.json", f"{release.TURBO_DIR}/"
                                 "TurboV3-Wan22-TinyShallow_7_7.json"])
def test_corrupt_json_named(rel, copy, tmp_path, capsys):
    (copy / rel).unlink()
    (copy / rel).write_text('{"model": {"type": "BPE", "vocab": ')
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, rel.rsplit("/", 1)[1], "not a readable JSON file")


def test_tensor_in_two_shards_named(copy, tmp_path, capsys):
    index = copy / release.PREVIEW_DIR / release.TRANSFORMER_INDEX
    wmap = json.loads(index.read_text())["weight_map"]
    a, b = sorted(set(wmap.values()))[:2]
    name = next(n for n, f in wmap.items() if f == a)
    tensors = load_file(copy / release.PREVIEW_DIR / b)
    tensors[name] = torch.zeros(1)
    (copy / release.PREVIEW_DIR / b).unlink()
    save_file(tensors, copy / release.PREVIEW_DIR / b)
    code, out = run(copy, tmp_path)
    refused(capsys, code, out, "1 tensors stored in two shards", f"{name} (in {a} and {b})")


def test_text_encoder_mismatch_list_is_cut(copy, tmp_path, capsys):
    single = copy / TE / "model.safetensors"
    tensors = {f"junk.{i}": torch.zeros(1) for i in range(500)} | load_file(single)
    single.unlink()
    save_file(tensors, single)
    code, out = run(copy, tmp_path)
    err = refused(capsys, code, out, "500 unexpected tensors", "... and")
    assert err.count("junk.") == MAX_LISTED
