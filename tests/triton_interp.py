"""Running headmoe's Triton kernels on CPU tensors under Triton's interpreter (tests only).

Importing this module sets TRITON_INTERPRET=1. triton decides between compiling and
interpreting when a kernel is defined, from TRITON_INTERPRET at that moment; headmoe's
`*_kernels` modules are imported at the first kernel call, and a test module importing
this one sets the variable at collection, before any test runs. (A process that imported
the kernels without it gets a RuntimeError on CPU tensors, `triton_runtime.check_tensors`.)

`row_local_dot`: the interpreter implements `tl.dot` with `numpy.matmul`, and numpy's
OpenBLAS fp32 GEMM gives a row different bits depending on its position in the block
(measured with numpy 2.4 / OpenBLAS 0.3.31: permuting the 32 rows of a 32x64 @ 64x64
product changed 18 rows in the last bit; fp16 operands go through the same fp32 GEMM). A
GPU's MMA computes every element the same way wherever its row sits (checked on the device
by benchmarks/gpu_check.py). So that the interpreter tests check the kernels' own data flow
(gathers, masks, tiles, reduction orders) rather than numpy's, the `interpreted` fixture
swaps in a dot that accumulates the k products one at a time in fp32, an order that is the
same for every element. Tolerance tests against the torch paths run under it too.

Without triton installed, every test using the fixture fails with a message saying so: a
CPU-only install deselects these tests with `-m "not triton"`, it does not skip them.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:
    from triton.runtime import interpreter as _interpreter
except ImportError:  # reported by the fixture, so the rest of the suite still collects
    _interpreter = None

MISSING = (
    "triton is not installed: the tests marked 'triton' need it (pip install -e '.[dev]'); "
    "a CPU-only install deselects them with -m 'not triton'"
)


def row_local_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """`InterpreterBuilder.create_dot` with a fixed per-element order: acc += a[:, j] b[j]
    for j = 0, 1, ... in the accumulator's dtype (elementwise numpy ops: the same bits for
    every row and column)."""
    acc = np.array(d.data, copy=True)
    a_data = a.data.astype(acc.dtype)
    b_data = b.data.astype(acc.dtype)
    for j in range(a_data.shape[-1]):
        acc += a_data[..., :, j : j + 1] * b_data[..., j : j + 1, :]
    return _interpreter.TensorHandle(acc, d.dtype.scalar)


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter with `row_local_dot`; fails the test if triton is missing."""
    if _interpreter is None:
        pytest.fail(MISSING)
    monkeypatch.setattr(_interpreter.InterpreterBuilder, "create_dot", row_local_dot)
    return _interpreter
