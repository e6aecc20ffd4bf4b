"""headmoe: multi-head-MoE diffusion transformers (MAGI-2 family) across many accelerators."""

from headmoe.config import ParallelConfig

__all__ = ["ParallelConfig", "__version__"]
__version__ = "0.1.0"
