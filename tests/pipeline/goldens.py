"""Golden data for the component tests: re-exported from :mod:`tests.goldens`."""

from tests.goldens import golden_dir, golden_file, released_tensors

__all__ = ["golden_dir", "golden_file", "released_tensors"]
