"""Where headmoe's Triton kernels may run, without importing triton unless asked.

`triton` is an optional dependency (the `gpu` extra): everything here imports it lazily, so
a CPU-only install never touches it. The kernels run on CUDA tensors, or on CPU tensors
under Triton's interpreter. Triton reads `TRITON_INTERPRET` when a kernel is *defined*
(`triton.jit` returns an interpreted function when it is "1" at that moment), so a process
that wants the interpreter must set it before the first import of a `*_kernels` module;
`check_tensors` raises a clear error when that did not happen.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from headmoe.config import is_int

if TYPE_CHECKING:  # triton is the GPU extra; the interpreter's handles type `row_local_dot`
    from triton.runtime.interpreter import TensorHandle

#: the float dtypes headmoe's Triton kernels take (fp32 with IEEE products, fp16, bf16)
KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def available() -> bool:
    """True when the `triton` package imports (tried once, on the first call: the layers ask
    only for CUDA tensors, so CPU-only runs never import it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether the model layers route `t` (any tensor) through the Triton kernels: on CUDA,
    when triton is installed. CPU tensors always take the torch paths."""
    return t.is_cuda and available()


def check_tile_sizes(tiles: object, names: tuple[str, ...]) -> None:
    """ValueError naming the first field of `tiles` (a tile dataclass) in `names` that is not
    a power of two >= 16 (the block sizes every kernel here takes)."""
    for name in names:
        v = getattr(tiles, name)
        if not is_int(v) or v < 16 or v & (v - 1):
            raise ValueError(f"{type(tiles).__name__}.{name} must be a power of two >= 16, "
                             f"got {v!r}")  # fmt: skip


def kernels(module: str) -> ModuleType:
    """The `*_kernels` module `module` (a dotted name), imported on first use: importing it
    imports triton and fixes compiled vs interpreted kernels (TRITON_INTERPRET)."""
    return importlib.import_module(module)


def descriptor(t: torch.Tensor, block: list[int], shape: list[int] | None = None,
               strides: list[int] | None = None) -> object:  # fmt: skip
    """A TMA tensor descriptor over t's storage with blocks `block`: of the contiguous 2-d
    tensor t (a copy when t is not contiguous) by default, or of the 2-d view `shape` /
    `strides` (elements, last stride 1) of t's storage when given."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if shape is None:
        return TensorDescriptor.from_tensor(t.contiguous(), block)
    return TensorDescriptor(t, shape, strides, block)


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` (a `triton.jit` result) was built for Triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_tensors(kernel: object, **tensors: torch.Tensor) -> torch.device:
    """The common device of `tensors` (name -> tensor), checked for `kernel`.

    Raises ValueError naming the first tensor on another device, and RuntimeError when the
    tensors are on the CPU but `kernel` was compiled for the GPU (TRITON_INTERPRET=1 was not
    set before the kernel module was first imported)."""
    names = list(tensors)
    device = tensors[names[0]].device
    for name in names[1:]:
        if tensors[name].device != device:
            raise ValueError(
                f"{name} must be on {device} like {names[0]}, got {tensors[name].device}"
            )
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 "
            "before headmoe's *_kernels modules are first imported"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{names[0]} must be on a CUDA device (or the CPU), got {device}")
    return device


def row_local_dot(self: object, a: TensorHandle, b: TensorHandle, d: TensorHandle,
                  input_precision: object, max_num_imprecise_acc: object) -> TensorHandle:
    """A replacement for the interpreter's `InterpreterBuilder.create_dot` whose bits do not
    depend on a row's place in its block: acc += a[:, j] * b[j] for j = 0, 1, ... in the
    accumulator's dtype (elementwise numpy ops).

    Why: the interpreter implements `tl.dot` with `numpy.matmul`, and numpy's OpenBLAS fp32
    GEMM gives a row different bits depending on its position in the block (measured with
    numpy 2.4 / OpenBLAS 0.3.31: permuting the 32 rows of a 32x64 @ 64x64 product changed
    18 rows in the last bit; fp16 operands go through the same fp32 GEMM). A GPU's MMA
    computes every element the same way wherever its row sits (checked on the device by
    benchmarks/gpu_check.py), so CPU checks of the kernels' batch invariance (their gathers,
    masks, tiles and reduction orders) run with this dot."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    acc = np.array(d.data, copy=True)
    a_data = a.data.astype(acc.dtype)
    b_data = b.data.astype(acc.dtype)
    for j in range(a_data.shape[-1]):
        acc += a_data[..., :, j : j + 1] * b_data[..., j : j + 1, :]
    return TensorHandle(acc, d.dtype.scalar)


def install_row_local_dot() -> object:
    """Make Triton's interpreter use `row_local_dot` in this process; returns the previous
    `create_dot` (to restore it). For CPU checks only: compiled kernels are unaffected."""
    from triton.runtime.interpreter import InterpreterBuilder

    previous = InterpreterBuilder.create_dot
    InterpreterBuilder.create_dot = row_local_dot
    return previous
