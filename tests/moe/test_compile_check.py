"""benchmarks/compile_check.py: headmoe's kernels still compile for sm_90a on a machine
without a GPU (one small kernel here, in a fresh process: the other triton tests run the
interpreter, and triton picks one mode per process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import interpreted  # noqa: F401  (fails the test without triton)

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]


def test_combine_kernel_compiles_for_hopper_without_spills(interpreted):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--kernels", "combine"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("combine"))
    assert "spill_bytes=    0" in line and "registers=" in line
