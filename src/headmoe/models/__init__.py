"""Model definitions (the MAGI-2 family)."""
