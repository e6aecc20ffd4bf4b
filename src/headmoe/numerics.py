"""CPU numerics that do not depend on the torch thread count.

headmoe promises the same output bytes for every layout and every torch thread count on one
machine and software stack (docs/architecture.md, "The determinism contract"). On a CPU the
thread count is a speed setting only; this module is the one home of what makes that true
for the BLAS.

oneMKL, the BLAS of torch's x86-64 builds, splits the reduction of a GEMM across threads
for some shapes (measured with torch 2.13.0+cpu on an Intel Xeon with AVX512:
``[298, 1536] @ [1536, 24]``, ``[16, 3072] @ [3072, 16]`` and ``[64, 5120] @ [5120, 5120]``
give other fp32 bits at 1, 2 and 3 threads), so a rank with more threads computed another
video. MKL's *conditional numerical reproducibility* mode with the ``STRICT`` flag makes
its GEMMs (``?gemm``, ``?trsm``, ``?symm``) bitwise independent of the thread count; the
``AUTO`` branch keeps the kernels of the running CPU (so results may still move between CPU
models, within the golden data's cross-CPU bars). The mode can only be chosen before MKL's
first computation in the process, which is why importing `headmoe` sets it.

The ops outside MKL that headmoe's models run (reductions, norms, softmax, convolutions)
are row-local or split with fixed chunking; tests/test_numerics.py checks every stage at 1, 2
and 3 threads with `torch.equal`.

A user who sets ``MKL_CBWR`` themselves (for example ``AVX2,STRICT``, the same branch on
every x86-64 CPU of a mixed fleet) keeps it when it includes ``STRICT``; one without it is
refused by `require_reproducible_blas` with the variable's value.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

#: MKL's CNR constants (oneMKL's ``mkl_service.h``): the branch field, the AUTO branch and
#: the STRICT flag, and the error ``mkl_cbwr_set`` returns once MKL has computed.
_CBWR_ALL = 0xFFFFFFFF
_CBWR_BRANCH_BITS = 0xFFFF
_CBWR_AUTO = 2
_CBWR_STRICT = 0x10000
_CBWR_MODE_CHANGE_FAILURE = -8
#: names of MKL's CNR branches as ``MKL_CBWR`` spells them, by code
_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1",
             8: "SSE4_2", 9: "AVX", 10: "AVX2", 12: "AVX512", 14: "AVX512_E1"}
#: the value headmoe asks MKL for
WANTED = "AUTO,STRICT"


@dataclass(frozen=True)
class BlasMode:
    """What this process's BLAS guarantees about the thread count."""

    blas: str
    """"mkl" (torch's x86-64 builds) or "other" (no MKL in this torch)."""
    mode: str
    """MKL's CNR setting as ``MKL_CBWR`` spells it (``"AUTO,STRICT"``), or "" without MKL."""
    thread_invariant: bool
    """True when GEMM results do not depend on the thread count."""
    problem: str = ""
    """Why not, in one sentence, when `thread_invariant` is False."""


def _mkl() -> ctypes.CDLL | None:
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not torch.backends.mkl.is_available() or not lib.is_file():  # type: ignore[no-untyped-call]
        return None
    handle = ctypes.CDLL(str(lib))
    if not hasattr(handle, "mkl_serv_cbwr_set"):
        return None
    return handle


def _spell(setting: int) -> str:
    branch = _BRANCHES.get(setting & _CBWR_BRANCH_BITS, str(setting & _CBWR_BRANCH_BITS))
    return branch + (",STRICT" if setting & _CBWR_STRICT else "")


def _configure() -> BlasMode:
    mkl = _mkl()
    if mkl is None:
        return BlasMode("other", "", False, "this torch has no oneMKL; its BLAS gives no "
                        "thread-count guarantee (headmoe's contract is tested on x86-64 "
                        "builds with oneMKL)")
    user = os.environ.get("MKL_CBWR")
    if user is None:
        mkl.mkl_serv_cbwr_set(_CBWR_AUTO | _CBWR_STRICT)
    setting = mkl.mkl_serv_cbwr_get(_CBWR_ALL)
    if setting & _CBWR_STRICT:
        return BlasMode("mkl", _spell(setting), True)
    if user is not None:
        why = (f"MKL_CBWR={user!r} does not include STRICT, so oneMKL's GEMMs depend on the "
               f"thread count; unset it or add STRICT (e.g. MKL_CBWR={WANTED})")
    else:
        why = ("oneMKL ran a computation before headmoe was imported, so its reproducible "
               f"mode could not be set; import headmoe first or set MKL_CBWR={WANTED}")
    return BlasMode("mkl", _spell(setting), False, why)


_MODE: BlasMode | None = None


def blas_mode() -> BlasMode:
    """This process's `BlasMode`; the first call (made by ``import headmoe``) sets MKL's
    reproducible mode when nothing has run MKL yet."""
    global _MODE
    if _MODE is None:
        _MODE = _configure()
    return _MODE


def require_reproducible_blas() -> BlasMode:
    """`blas_mode`, raising `headmoe.errors.UserError` with its problem when MKL is present
    but not thread-invariant (a run would not give the promised bytes). Call it before any
    collective: every rank of a job runs the same check on the same software stack."""
    from headmoe.errors import UserError

    mode = blas_mode()
    if mode.blas == "mkl" and not mode.thread_invariant:
        raise UserError(mode.problem)
    return mode


def numerics_record() -> dict[str, object]:
    """What a sidecar records of this process's CPU numerics: the BLAS and its mode, ATen's
    CPU dispatch (``ATEN_CPU_CAPABILITY`` picks it) and the torch threads of this rank."""
    import torch

    mode = blas_mode()
    return {"blas": mode.blas, "blas_mode": mode.mode,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads()}
