"""Session set-up of the test suite.

- Import headmoe before torch and before any test computes: it sets its OpenMP defaults
  before torch loads OpenMP (`headmoe.OPENMP_DEFAULTS`) and puts oneMKL into its
  thread-count-independent mode, which can only be chosen before MKL's first computation
  (headmoe.numerics).
- ``HEADMOE_TEST_TORCH_THREADS=N`` runs the session's tests at N torch threads (more than
  the cores too, which ``OMP_NUM_THREADS`` does not give): tests/test_golden_dispatch.py
  reruns the golden tests that way.
"""

# isort: off
import os

import headmoe  # first: its OpenMP defaults apply before torch loads its runtime
import headmoe.numerics
import torch

# isort: on

if os.environ.get("HEADMOE_TEST_TORCH_THREADS"):
    torch.set_num_threads(int(os.environ["HEADMOE_TEST_TORCH_THREADS"]))


def pytest_report_header(config):
    """What the session's numbers depend on: threads, ATen's CPU dispatch, the BLAS mode."""
    mode = headmoe.numerics.blas_mode()
    return (f"torch threads: {torch.get_num_threads()}, ATen CPU dispatch: "
            f"{torch.backends.cpu.get_cpu_capability()}, BLAS: {mode.blas} {mode.mode}")
