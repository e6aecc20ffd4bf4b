"""Session set-up of the test suite.

- Import headmoe before torch and before any test computes: it sets its OpenMP defaults
  before torch loads OpenMP (`headmoe.OPENMP_DEFAULTS`) and puts oneMKL into its
  thread-count-independent mode, which can only be chosen before MKL's first computation
  (headmoe.numerics).
- ``HEADMOE_TEST_TORCH_THREADS=N`` runs the session's tests at N torch threads (more than
  the cores too, which ``OMP_NUM_THREADS`` does not give): tests/test_golden_dispatch.py
  reruns the golden tests that way.
- `tiny_release_in`: the tiny release is written once per session (it takes ~10-35 s on a
  loaded 2-core machine) and hard-linked into each test's cache that asks for it.
"""

# isort: off
import os

import headmoe  # first: its OpenMP defaults apply before torch loads its runtime
import headmoe.numerics
import torch

# isort: on
import shutil
from pathlib import Path

import pytest

if os.environ.get("HEADMOE_TEST_TORCH_THREADS"):
    torch.set_num_threads(int(os.environ["HEADMOE_TEST_TORCH_THREADS"]))


def pytest_report_header(config):
    """What the session's numbers depend on: threads, ATen's CPU dispatch, the BLAS mode."""
    mode = headmoe.numerics.blas_mode()
    return (f"torch threads: {torch.get_num_threads()}, ATen CPU dispatch: "
            f"{torch.backends.cpu.get_cpu_capability()}, BLAS: {mode.blas} {mode.mode}")


@pytest.fixture(scope="session")
def tiny_release_master(tmp_path_factory) -> Path:
    """The session's one tiny release folder (`headmoe.release.folder.tiny_release`)."""
    from headmoe.release import folder as release

    return release.tiny_release(tmp_path_factory.mktemp("tiny-release"))


@pytest.fixture(scope="session")
def tiny_release_in(tiny_release_master):
    """``seed(cache) -> Path``: what ``release.tiny_release(cache)`` returns, without writing
    the release again: the session's folder hard-linked into ``cache`` under the same name
    (the same bytes; `tiny_release` then finds it there). Tests replace its files, never
    write into them (a write would reach the session's folder through the link)."""
    from headmoe.release import folder as release

    def seed(cache: Path) -> Path:
        path = release.tiny_release(cache, write=False)
        if not path.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(tiny_release_master, path, copy_function=os.link)
        return release.tiny_release(cache)

    return seed
