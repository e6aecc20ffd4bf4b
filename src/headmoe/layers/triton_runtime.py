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
import importlib.util

import torch


@functools.cache
def available() -> bool:
    """True when the `triton` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the model layers route `t` (any tensor) through the Triton kernels: on CUDA,
    when triton is installed. CPU tensors always take the torch paths."""
    return t.is_cuda and available()


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
