"""headmoe: multi-head-MoE diffusion transformers (MAGI-2 family) across many accelerators."""

import os

#: OpenMP settings headmoe's CPU ranks run with unless the environment sets them: a thread
#: that has finished its part of a parallel region sleeps instead of spinning, so on a
#: machine whose cores are shared (with other ranks, other jobs) a waiting thread does not
#: take the core from the one everybody waits for (issue 31: 2 threads of one rank on 2
#: shared cores spun 20x slower than one thread; docs/benchmarks.md section 12). They must
#: be set before torch loads its OpenMP runtime, hence here, before any torch import.
#: Speed only: the thread count and these settings do not change results.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
for _name, _value in OPENMP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

from headmoe.config import ParallelConfig  # noqa: E402
from headmoe.numerics import blas_mode  # noqa: E402

# before anything computes: oneMKL's thread-count-independent mode (headmoe.numerics)
blas_mode()

__all__ = ["MIN_TORCH", "ParallelConfig", "__version__", "check_torch"]
__version__ = "0.1.0"
#: the oldest torch headmoe runs on (pyproject.toml's requirement; transformers 5.24's
#: minimum, and the first torch whose ``torch.load(weights_only=True)`` allowlist and
#: ``mmap`` read the release's ``checkpoint.ckpt``)
MIN_TORCH = "2.6"


def check_torch(version: str | None = None) -> None:
    """Raise `headmoe.errors.UserError` when torch ``version`` (default: the installed one)
    is older than `MIN_TORCH`."""
    import torch

    from headmoe.errors import UserError

    version = version or torch.__version__
    have = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    if have < tuple(int(p) for p in MIN_TORCH.split(".")):
        raise UserError(f"torch {version} is older than {MIN_TORCH}, the oldest headmoe runs "
                        f"on; install torch>={MIN_TORCH} (the README's set-up command)")
