"""benchmarks/gpu_check.py's dry run: every section's code path on the CPU under Triton's
interpreter (tiny shapes, no timing), so the device check cannot rot between GPU runs; and
a section that fails still leaves a complete report."""

import json

import pytest
import torch

from benchmarks import gpu_check
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = pytest.mark.triton


def _table(text: str) -> tuple[dict[str, str], list[list[str]]]:
    """(section -> status, result rows as cells) of a report."""
    lines = [x for x in text.splitlines() if x.startswith("| ") and "---" not in x]
    status = {x.split("|")[1].split()[0]: x.split("|")[2].strip() for x in lines
              if x.split("|")[1].strip()[:2] in {f"{k} " for k in gpu_check.SECTIONS}}  # fmt: skip
    rows = [[c.strip() for c in x.split("|")[1:-1]] for x in lines
            if x.split("|")[1].strip() in gpu_check.SECTIONS]  # fmt: skip
    return status, rows


def test_dry_run_passes_every_check_and_writes_the_report(tmp_path, interpreted):  # noqa: F811
    out = tmp_path / "gpu_check.md"
    # the budget stops timed work on a GPU; a dry run times nothing, so a loaded machine
    # must not stop it
    assert gpu_check.main(["--dry-run", "--out", str(out), "--budget-s", "3600"]) == 0
    text = out.read_text()
    assert text.startswith("# GPU check (dry run") and "- device: CPU" in text
    status, rows = _table(text)
    assert set(status) == set(gpu_check.SECTIONS)
    assert all(v.startswith("ok (") for v in status.values()), status
    sections = [r[0] for r in rows]
    assert set(sections) == set(gpu_check.SECTIONS)
    assert all(len(r) == 6 for r in rows), [r for r in rows if len(r) != 6]  # no "|" in a cell
    checks = [r for r in rows if r[5]]
    assert all(r[5] == "ok" for r in checks) and "FAIL" not in text
    assert sum(r[0] == "a" for r in checks) == 10 and sum(r[0] == "b" for r in checks) == 3
    assert any("gather A/B" in r[1] and r[3].startswith("0 rows differ") for r in rows)
    assert any("_grouped_mm" in r[1] for r in rows) and any("kernel:" in r[1] for r in rows)
    assert any("SDPA flash" in r[1] for r in rows) and any("SDPA cuDNN" in r[1] for r in rows)
    assert any("flash path (math (dry stand-in)) with the sink" in r[1] for r in rows)
    proof = json.loads((tmp_path / "gpu_check.md.cache" / "attention_proof.json").read_text())
    assert [k.split(" | ")[-1] for k in proof] == ["math (dry stand-in)"]
    assert any(r[0] == "0" and "shared=" in r[3] and "/232,448" in r[3] for r in rows)
    assert sum(r[0] == "f" and "streamed output == resident output" in r[1] for r in checks) == 2
    assert sum(r[0] == "i" for r in checks) == 5  # FP8: error, two widenings, rows, layer
    assert any(r[0] == "i" and "Fp8Experts" in r[1] for r in checks)
    fp8 = [r for r in rows if r[0] == "i" and r[1].startswith("experts, ")]
    assert len(fp8) == 2 * len(gpu_check.DRY.moe_tokens), fp8  # bf16 and FP8 per count
    assert all(r[3] == "ran (dry)" for r in fp8), fp8  # timed (TFLOP/s, GB/s) on a GPU only
    graphs = [r for r in rows if r[0] == "k"]  # CUDA graphs, captured with the CPU stand-in
    assert [r[5] for r in graphs] == ["ok", "ok", "", ""], graphs
    assert graphs[0][3] == "1 graph(s), 2 replays, refused: none"
    assert graphs[1][3] == "1 eager call(s)" and graphs[2][3] == "ran (dry); ran (dry)"


def test_a_failing_section_leaves_a_complete_report(tmp_path, interpreted, capsys):  # noqa: F811
    """Sections 0, a and c made to fail (a parameter, not an env var): the sections after a
    failure still run and pass (b between two failures, e after the last), the report names
    the failures and the sections not chosen, the exit status is 1. (Only these five run:
    the full dry run is the test above.)"""
    out = tmp_path / "gpu_check.md"
    argv = ["--dry-run", "--out", str(out), "--sections", "0,a,b,c,e"]
    for s in ("0", "a", "c"):
        argv += ["--inject-failure", s]
    assert gpu_check.main(argv) == 1
    status, rows = _table(out.read_text())
    assert set(status) == set(gpu_check.SECTIONS)
    for s in ("0", "a", "c"):
        assert status[s].startswith("FAILED: RuntimeError: injected failure in section " + s)
    for s in ("b", "e"):
        assert status[s].startswith("ok ("), status
    assert {s for s, v in status.items() if v == "not run"} == set(gpu_check.SECTIONS) - set("0abce")
    assert {r[0] for r in rows} == {"b", "e"}
    assert "section c: FAILED" in capsys.readouterr().err


def test_sections_flag_refuses_an_unknown_section(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "s.md"), "--sections", "a,zz"])
    assert "--sections: unknown section(s) ['zz']" in capsys.readouterr().err
    assert not (tmp_path / "s.md").exists()


def test_budget_and_device_refusals(tmp_path, capsys, monkeypatch):
    """No CUDA device: exit 2 and no file; a spent budget stops the sections with a status
    (not an exception) and exit 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "x.md")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "y.md"), "--budget-s", "0"])


def test_a_spent_budget_stops_sections_with_a_status(tmp_path, interpreted):  # noqa: F811
    out = tmp_path / "z.md"
    argv = ["--dry-run", "--out", str(out), "--budget-s", "1e-9", "--inject-failure", "0"]
    assert gpu_check.main(argv) == 1
    status, _ = _table(out.read_text())
    assert status["0"].startswith("FAILED")
    for s in ("a", "b", "c", "d", "e"):
        assert status[s].startswith("stopped: the --budget-s budget ran out"), status
