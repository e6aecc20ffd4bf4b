"""The BLAS mode of headmoe.numerics: oneMKL strict reproducibility is set at import, a
user's MKL_CBWR with STRICT is kept, one without it and a too-late import are refused with
the reason (in a fresh interpreter each: MKL's mode is chosen once per process)."""

import subprocess
import sys

import pytest

import headmoe
from headmoe.cli.main import main
from headmoe.numerics import blas_mode, numerics_record


def _mode(env_value: str | None, before: str = "") -> str:
    code = (f"import torch\n{before}\nimport headmoe.numerics as n\nm = n.blas_mode()\n"
            "print(m.mode, m.thread_invariant, m.problem, sep='|')")
    env = {"PATH": "/usr/bin:/bin"}
    if env_value is not None:
        env["MKL_CBWR"] = env_value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    return out.stdout.strip()


def test_this_process_is_strict():
    # tests/conftest.py imports headmoe before anything computes
    mode = blas_mode()
    assert mode.blas == "mkl" and mode.thread_invariant and mode.mode == "AUTO,STRICT"
    rec = numerics_record()
    assert rec["blas_mode"] == "AUTO,STRICT" and rec["torch_threads"] >= 1
    assert headmoe.numerics.require_reproducible_blas() is mode


@pytest.mark.parametrize("value, expect", [
    (None, "AUTO,STRICT|True|"),
    ("AVX2,STRICT", "AVX2,STRICT|True|"),
])
def test_strict_modes(value, expect):
    assert _mode(value) == expect


def test_user_mode_without_strict_is_named():
    mode, invariant, problem = _mode("AVX2").split("|")
    assert (mode, invariant) == ("AVX2", "False")
    assert "MKL_CBWR='AVX2' does not include STRICT" in problem


def test_computing_before_import_is_named():
    out = _mode(None, "torch.randn(300, 1536) @ torch.randn(1536, 24)")
    mode, invariant, problem = out.split("|")
    assert invariant == "False" and "before headmoe was imported" in problem


def test_cli_refuses_a_non_strict_mode_in_one_line(monkeypatch, capsys):
    from headmoe import numerics

    monkeypatch.setattr(numerics, "_MODE", numerics.BlasMode(
        "mkl", "AVX2", False, "MKL_CBWR='AVX2' does not include STRICT"))
    assert main(["plan", "--model", "magi2-preview", "--world-size", "8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["headmoe: error: MKL_CBWR='AVX2' does not include STRICT"]
