"""CPU numerics that do not depend on the torch thread count.

headmoe promises the same output bytes for every layout and every torch thread count on one
machine and software stack (docs/architecture.md, "The determinism contract"). On a CPU the
thread count is a speed setting only; this module is the one home of what makes that true
for the BLAS.

oneMKL, the BLAS of torch's x86-64 builds, splits the reduction of a GEMM across threads
for some shapes (measured with torch 2.13.0+cpu on an Intel Xeon with AVX512:
``[298, 1536] @ [1536, 24]``, ``[16, 3072] @ [3072, 16]`` and ``[64, 5120] @ [5120, 5120]``
give other fp32 bits at 1, 2 and 3 threads), so a rank with more threads computed another
video. Two mechanisms make its GEMMs thread-count independent:

- **strict CNR.** MKL's *conditional numerical reproducibility* mode with the ``STRICT``
  flag makes ``?gemm``, ``?trsm``, ``?symm`` bitwise independent of the thread count, but
  only on its AVX2 and AVX-512 code branches (oneMKL developer guide, "Reproducibility
  Conditions"), which it runs on Intel CPUs only: a CI machine with another vendor's CPU
  reported ``AUTO,STRICT`` for a requested ``AVX2,STRICT`` and gave other GEMM bits at 3
  threads than at 1. On this Xeon the ``SSE4_2`` and ``COMPATIBLE`` branches with
  ``STRICT`` also changed bits with the thread count (``[298, 1536] @ [1536, 24]``,
  ``[64, 5120] @ [5120, 512]``). The mode can only be chosen before MKL's first
  computation in the process, which is why importing `headmoe` sets ``AUTO,STRICT``.
- **one BLAS thread.** Where strict CNR does not hold (`BlasMode.strict` is False),
  `reproducible_blas` runs oneMKL on one thread (its thread-local count, which
  ``torch.set_num_threads`` would otherwise set): one thread's GEMM has one summation order.
  Every CPU GEMM of headmoe's models runs inside it (`headmoe.layers.matmul`,
  `headmoe.moe.gemm`), and so does a whole request (`headmoe.pipeline.job.run_request`:
  text encoder, decoders). Only MKL is pinned; headmoe's other ops keep every thread.

The ops outside MKL that headmoe's models run (reductions, norms, softmax, convolutions)
are row-local or split with fixed chunking; tests/test_numerics.py checks every stage at 1, 2
and 3 threads with `torch.equal`.

A user who sets ``MKL_CBWR`` themselves (for example ``AVX2,STRICT``, the same branch on
every Intel CPU of a mixed fleet) keeps it when it includes ``STRICT``; one without it is
refused by `require_reproducible_blas` with the variable's value.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
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
             8: "SSE4_2", 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512",
             13: "AVX512_MIC_E1", 14: "AVX512_E1"}
#: the branches on which STRICT makes MKL's GEMMs thread-count independent (AVX2, AVX-512)
_STRICT_BRANCHES = frozenset({10, 11, 12, 13, 14})
#: the CPU vendor those branches run on (``/proc/cpuinfo``'s ``vendor_id``)
_STRICT_VENDOR = "GenuineIntel"
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
    """True when headmoe's GEMMs do not depend on the thread count (by `strict` CNR, or on
    one BLAS thread inside `reproducible_blas`)."""
    problem: str = ""
    """Why not, in one sentence, when `thread_invariant` is False."""
    branch: str = ""
    """The code branch MKL's kernels take (``AUTO`` resolved: ``"AVX512_E1"``), or ""."""
    strict: bool = False
    """True when MKL's strict CNR holds here (STRICT set, an AVX2 / AVX-512 branch, an
    Intel CPU); when False but `thread_invariant`, `reproducible_blas` runs MKL on one
    thread."""

    @property
    def one_thread(self) -> bool:
        """True when `reproducible_blas` pins oneMKL to one thread."""
        return self.thread_invariant and not self.strict


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


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's ``vendor_id`` (``"GenuineIntel"``, ``"AuthenticAMD"``), or "" when the
    file does not say."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _branch(mkl: ctypes.CDLL, setting: int) -> int:
    code = setting & _CBWR_BRANCH_BITS
    if code == _CBWR_AUTO and hasattr(mkl, "mkl_serv_cbwr_get_auto_branch"):
        return int(mkl.mkl_serv_cbwr_get_auto_branch())
    return code


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
    code = _branch(mkl, setting)
    branch = _BRANCHES.get(code, str(code))
    if setting & _CBWR_STRICT:
        strict = code in _STRICT_BRANCHES and cpu_vendor() == _STRICT_VENDOR
        return BlasMode("mkl", _spell(setting), True, branch=branch, strict=strict)
    if user is not None:
        why = (f"MKL_CBWR={user!r} does not include STRICT, so oneMKL's GEMMs depend on the "
               f"thread count; unset it or add STRICT (e.g. MKL_CBWR={WANTED})")
    else:
        why = ("oneMKL ran a computation before headmoe was imported, so its reproducible "
               f"mode could not be set; import headmoe first or set MKL_CBWR={WANTED}")
    return BlasMode("mkl", _spell(setting), False, why, branch=branch)


_MODE: BlasMode | None = None
#: MKL's handle when `reproducible_blas` pins it (set once by `blas_mode`), else None
_PIN: ctypes.CDLL | None = None


def blas_mode() -> BlasMode:
    """This process's `BlasMode`; the first call (made by ``import headmoe``) sets MKL's
    reproducible mode when nothing has run MKL yet."""
    global _MODE, _PIN
    if _MODE is None:
        _MODE = _configure()
        _PIN = _mkl() if _MODE.one_thread else None
    return _MODE


@contextmanager
def reproducible_blas() -> Iterator[None]:
    """Run the block with thread-count-independent oneMKL GEMMs: a no-op where strict CNR
    holds (`BlasMode.strict`), else oneMKL on one thread for the calling thread (its
    thread-local count, restored on exit; nesting is fine)."""
    pin = _PIN
    if pin is None:
        yield
        return
    before = pin.mkl_serv_set_num_threads_local(1)
    try:
        yield
    finally:
        pin.mkl_serv_set_num_threads_local(before)


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
    """What a sidecar records of this process's CPU numerics: the BLAS, its mode and code
    branch and whether `reproducible_blas` pins it to one thread, ATen's CPU dispatch
    (``ATEN_CPU_CAPABILITY`` picks it) and the torch threads of this rank."""
    import torch

    mode = blas_mode()
    return {"blas": mode.blas, "blas_mode": mode.mode, "blas_branch": mode.branch,
            "blas_one_thread": mode.one_thread,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads()}
