"""The BLAS mode of headmoe.numerics: oneMKL strict reproducibility is set at import, a
user's MKL_CBWR with STRICT is kept, one without it and a too-late import are refused with
the reason (in a fresh interpreter each: MKL's mode is chosen once per process)."""

import subprocess
import sys

import pytest

import headmoe
from headmoe.cli.main import main
from headmoe.numerics import blas_mode, cpu_vendor, numerics_record


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


@pytest.mark.parametrize("value, modes", [
    (None, {"AUTO,STRICT"}),
    # MKL runs its AVX2 branch on Intel CPUs only and reports AUTO on others
    ("AVX2,STRICT", {"AVX2,STRICT", "AUTO,STRICT"}),
])
def test_strict_modes(value, modes):
    mode, invariant, problem = _mode(value).split("|")
    assert mode in modes and invariant == "True" and problem == ""


def test_user_mode_without_strict_is_named():
    mode, invariant, problem = _mode("AVX2").split("|")
    assert mode in {"AVX2", "AUTO"} and invariant == "False"
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


def test_cpu_vendor_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_vendor(str(info)) == "AuthenticAMD"
    info.write_text("processor\t: 0\n")
    assert cpu_vendor(str(info)) == ""
    assert cpu_vendor(str(tmp_path / "missing")) == ""


def test_record_names_the_branch_and_the_pin():
    rec, mode = numerics_record(), blas_mode()
    assert rec["blas_branch"] == mode.branch and mode.branch not in ("", "AUTO")
    assert rec["blas_one_thread"] is mode.one_thread
    assert mode.one_thread is (mode.thread_invariant and not mode.strict)


# Under MKL's COMPATIBLE branch strict CNR does not hold (measured: plain fp32 products of
# these shapes change bits with the thread count on an Intel Xeon), as on a CPU whose
# vendor MKL's AVX2 / AVX-512 branches do not run on: headmoe falls back to one MKL thread.
_ONE_THREAD = """
import torch, headmoe
from headmoe.numerics import blas_mode, reproducible_blas
from headmoe.layers.matmul import bi_bmm, bi_linear, bi_matmul
from headmoe.moe.gemm import grouped_mm
m = blas_mode()
assert (m.branch, m.strict, m.thread_invariant, m.one_thread) == ("COMPATIBLE", False, True, True), m
g = torch.Generator().manual_seed(2)
outs = []
for threads in (1, 2, 3):
    torch.set_num_threads(threads)
    row = []
    for mm, k, n in [(298, 1536, 24), (298, 1536, 64), (16, 3072, 16), (300, 2048, 512), (64, 5120, 512)]:
        g.manual_seed(mm * k + n)
        x, w = torch.randn(mm, k, generator=g), torch.randn(n, k, generator=g)
        a3, b3 = x.view(2, mm // 2, k), torch.stack([w.t(), w.t().flip(0)])
        ends = torch.tensor([mm // 3, mm], dtype=torch.int32)
        row += [bi_linear(x, w), bi_matmul(x, w.t()), bi_bmm(a3, b3),
                bi_linear(x.bfloat16(), w.bfloat16()), grouped_mm(x, b3, ends)]
        with reproducible_blas():
            row.append(x @ w.t())
    outs.append(row)
for other in outs[1:]:
    assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
print("ok", len(outs[0]))
"""


def test_one_mkl_thread_where_strict_does_not_hold():
    env = {"PATH": "/usr/bin:/bin", "MKL_CBWR": "COMPATIBLE,STRICT"}
    out = subprocess.run([sys.executable, "-c", _ONE_THREAD], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "30"]
