"""The golden tests (marker ``golden``) once more in a fresh interpreter under the other ATen
CPU dispatch and another torch thread count, so a bar that depends on the instruction set
shows here before it does on a user's machine: under ``ATEN_CPU_CAPABILITY=avx2`` (or, when
this session already runs under a forced dispatch, the default one) with 3 threads.

The bars are golden/CROSS_CPU.md's (tests/goldens.py `cross_cpu_bar`), which hold on any
x86-64 CPU; the layout tests stay bitwise on one machine."""

import os
import subprocess
import sys

import pytest

from tests.goldens import REPO


def _other_dispatch_env() -> tuple[dict[str, str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["HEADMOE_TEST_TORCH_THREADS"] = "3"
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        env.pop("ATEN_CPU_CAPABILITY")
    else:
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    return env, env.get("ATEN_CPU_CAPABILITY", "default")


@pytest.mark.multirank  # the golden set includes its multi-rank layouts
def test_golden_tests_pass_under_the_other_dispatch():
    env, dispatch = _other_dispatch_env()
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, timeout=120)
    capability = probe.stdout.strip()
    if dispatch == "avx2":
        assert capability == "AVX2"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "golden", "-p", "no:cacheprovider",
         "tests"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=900)
    tail = "\n".join(proc.stdout.splitlines()[-25:])
    assert "torch threads: 3" in proc.stdout, tail
    assert proc.returncode == 0, f"golden tests under {dispatch}, 3 threads:\n{tail}"
    assert " passed" in tail and "failed" not in tail, tail
