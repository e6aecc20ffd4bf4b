"""benchmarks/compile_check.py: headmoe's kernels still compile for sm_90a on a machine
without a GPU (one small kernel here, in a fresh process: the other triton tests run the
interpreter, and triton picks one mode per process)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import interpreted  # noqa: F401  (fails the test without triton)

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]


def _compile_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_kernels_compile_for_hopper_within_the_shared_memory_limit(interpreted):  # noqa: F811
    """combine and the dense RMSNorm: no spills, shared memory reported against 232,448."""
    run = _compile_check("--kernels", "combine,rms_norm")
    assert run.returncode == 0, run.stderr[-2000:]
    for name in ("combine", "rms_norm"):
        line = next(x for x in run.stdout.splitlines() if x.startswith(name))
        assert "spill_bytes=    0" in line and "registers=" in line
        assert re.search(r"shared=[\d,]+/232,448 ", line), line


def test_a_kernel_over_the_shared_memory_limit_fails_loudly(interpreted):  # noqa: F811
    """With a (pretend) device limit below what rms_norm needs (8,192 bytes), the check
    exits 1 and names the kernel, its bytes and the limit on stderr."""
    run = _compile_check("--kernels", "rms_norm", "--smem-limit", "4096")
    assert run.returncode == 1
    assert re.search(r"compile_check FAILED: rms_norm: needs [\d,]+ bytes of shared memory, "
                     r"over the device limit of 4,096 bytes", run.stderr), run.stderr[-2000:]
