"""benchmarks/gpu_check.py's dry run: every section's code path on the CPU under Triton's
interpreter (tiny shapes, no timing), so the device check cannot rot between GPU runs."""

import pytest
import torch
from benchmarks import gpu_check

from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = pytest.mark.triton


def test_dry_run_passes_every_check_and_writes_the_table(tmp_path, interpreted):  # noqa: F811
    out = tmp_path / "gpu_check.md"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("GPU check (dry run")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    sections = [line.split("|")[1].strip() for line in rows[1:]]
    assert sections.count("a") == 7 and "b" in sections and "c" in sections
    assert sections.count("d") == len(gpu_check.layer_parts(gpu_check.DRY, torch.float32)) + 1
    assert "FAIL" not in text and text.count("| ok |") == 7
    assert text.count("ran (dry)") == len(rows) - 1 - 7


def test_without_a_gpu_the_full_run_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "x.md")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()
