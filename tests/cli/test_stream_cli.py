"""`generate --offload-layers` admission (issue 20): the memory check uses the streamed
estimate, so MAGI-2 Preview's shape passes a budget its resident weights do not, before any
weight is read; bad streaming flags are named."""

from __future__ import annotations

import re

import pytest

from headmoe.cli.main import main
from headmoe.release.components import resolve_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return resolve_model("tiny", tmp_path_factory.mktemp("cache"))[1]


def _error(capsys, tmp_path, ckpt, *flags) -> str:
    argv = ["generate", "--prompt", "x", "--model", ckpt, "--model-config", "magi2-preview",
            "--output", str(tmp_path / "o.mp4"), "--no-progress", "--max-memory-gib", "100", "--dtype", "bf16",
            *flags]
    assert main(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("headmoe: error: "), lines
    assert not (tmp_path / "o.mp4").exists()
    return lines[0]


def test_streamed_estimate_admits_what_resident_weights_do_not(capsys, tmp_path, ckpt):
    over = "more than the 100.00 GiB limit (--max-memory-gib)"
    assert over in _error(capsys, tmp_path, ckpt)  # 212 GiB of resident weights
    # streamed: the memory check passes; the (tiny) checkpoint's headers are checked next
    streamed = _error(capsys, tmp_path, ckpt, "--offload-layers")
    assert "--max-memory-gib" not in streamed and "num_layers=40" in streamed
    # all 40 layers resident again: refused by the same estimate
    assert over in _error(capsys, tmp_path, ckpt, "--offload-layers", "--resident-layers", "40")


@pytest.mark.parametrize(("flags", "pattern"), [
    (("--offload-layers", "--resident-layers", "41"),
     r"--resident-layers must be in \[0, 40\].*got 41"),
    (("--resident-layers", "3"), r"--resident-layers 3 needs --offload-layers"),
])
def test_bad_streaming_flags_are_named(capsys, tmp_path, ckpt, flags, pattern):
    assert re.search(pattern, _error(capsys, tmp_path, ckpt, *flags))
