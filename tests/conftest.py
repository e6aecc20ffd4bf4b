"""Import headmoe before any test computes: it puts oneMKL into its thread-count-independent
mode, which can only be chosen before MKL's first computation (headmoe.numerics)."""

import headmoe  # noqa: F401
