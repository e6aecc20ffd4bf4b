"""Test support shipped with the package (so spawned ranks can import it)."""

from headmoe.testing.multirank import RankFailure, RankTimeout, run_ranks, spawned_rank_pids

__all__ = ["RankFailure", "RankTimeout", "run_ranks", "spawned_rank_pids"]
