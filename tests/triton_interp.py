"""Running headmoe's Triton kernels on CPU tensors under Triton's interpreter (tests only).

Importing this module sets TRITON_INTERPRET=1. triton decides between compiling and
interpreting when a kernel is defined, from TRITON_INTERPRET at that moment; headmoe's
`*_kernels` modules are imported at the first kernel call, and a test module importing
this one sets the variable at collection, before any test runs. triton's own library
functions are defined when triton is first imported, so a process that imported triton
before the variable was set cannot interpret (measured: reloading headmoe's kernel modules
then fails inside `tl.max`); the `interpreted` fixture fails such a run with a message.

The `interpreted` fixture also swaps the interpreter's dot for
`headmoe.layers.triton_runtime.row_local_dot` (numpy's matmul gives a row different bits
depending on its place in the block; the docstring there has the measurement), so that the
bit-invariance tests check the kernels' own data flow. Tolerance tests run under it too.

Without triton installed, every test using the fixture fails with a message saying so: a
CPU-only install deselects these tests with `-m "not triton"`, it does not skip them.
"""

from __future__ import annotations

import importlib
import os

import pytest

from headmoe.layers import triton_runtime

os.environ["TRITON_INTERPRET"] = "1"

#: one kernel of each kernel module (module, name)
KERNELS = (
    ("headmoe.moe.triton_moe_kernels", "route_kernel"),
    ("headmoe.layers.triton_attention_kernels", "sink_attention_kernel"),
    ("headmoe.layers.triton_range_attention_kernels", "range_attention_kernel"),
    ("headmoe.layers.triton_dense_kernels", "matmul_kernel"),
    ("headmoe.layers.triton_mhc_kernels", "mhc_coeffs_kernel"),
)
MISSING = (
    "triton is not installed: the tests marked 'triton' need it (pip install -e '.[dev]'); "
    "a CPU-only install deselects them with -m 'not triton'"
)


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter with the row-local dot; fails the test if triton is missing."""
    if not triton_runtime.available():
        pytest.fail(MISSING)
    from triton.runtime import interpreter

    for name, kernel in KERNELS:
        if not triton_runtime.is_interpreted(getattr(importlib.import_module(name), kernel)):
            pytest.fail(
                f"{name} was compiled for the GPU: triton was imported before TRITON_INTERPRET=1 "
                "was set; run the triton tests in a fresh process or with TRITON_INTERPRET=1"
            )
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", triton_runtime.row_local_dot)
    return interpreter
