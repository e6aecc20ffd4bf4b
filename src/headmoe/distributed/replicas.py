"""Data-parallel replicas: each DP group of a world joined as a torch.distributed world of
its own, the replicas meeting only through the launch's c10d store.

Notation
--------
    S = SP x CFG          ranks per replica
    D                     replicas (the DP degree); world = S x D
    rank = local + S * k  global rank of local rank ``local`` of replica ``k`` (DP
                          outermost, as `headmoe.distributed.topology.Topology` numbers it)

A served request runs on one replica, never across two: `join_replica` initialises the
default process group of replica ``k`` on the prefix ``headmoe/replica<k>/`` of the launch's
store (`launch_store`: the one `headmoe.distributed.launch.LocalRanks` or torchrun's agent
hosts), with the replica's own config (`replica_config`: DP 1). Every collective a job
issues, including the job's default-group ones and its heartbeats, then stays inside its
replica, and replica k's local rank 0 is that job's writer (`is_output_coords`).

Worked table, ``--nproc 4 --ulysses-degree 2 --data-parallel-size 2`` (S = 2):

    ====  =======  =====  ===========================
    rank  replica  local  role
    ====  =======  =====  ===========================
    0     0        0      HTTP front end, replica 0's leader and writer
    1     0        1
    2     1        0      replica 1's leader and writer
    3     1        1
    ====  =======  =====  ===========================

What crosses replicas goes through `serve_store` (the prefix ``headmoe/serve/``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.topology import plan_topology

if TYPE_CHECKING:  # torch.distributed is imported where a rank starts, not at import
    from torch.distributed import Store  # type: ignore[attr-defined]

#: the launch store's prefix of replica k's own process group
REPLICA_PREFIX = "headmoe/replica{}/"
#: the launch store's prefix of what crosses replicas (`serve_store`)
SERVE_PREFIX = "headmoe/serve/"


@dataclass(frozen=True)
class ReplicaPlace:
    """One rank's place among the replicas of its world (module notation)."""

    rank: int
    """The global rank."""
    replica: int
    """k: the replica (DP group) the rank belongs to."""
    replicas: int
    """D: the replicas of the world."""
    size: int
    """S: ranks per replica."""

    @property
    def local_rank(self) -> int:
        """The rank inside its replica's world (``rank - S * k``)."""
        return self.rank - self.size * self.replica

    @property
    def leads(self) -> bool:
        """Local rank 0: the replica's leader (it hears the front end) and its writer."""
        return self.local_rank == 0

    def ranks(self, replica: int | None = None) -> list[int]:
        """The global ranks of ``replica`` (default this rank's), in local-rank order."""
        k = self.replica if replica is None else replica
        return list(range(k * self.size, (k + 1) * self.size))

    def global_rank(self, local: int, replica: int | None = None) -> int:
        """The global rank of local rank ``local`` of ``replica`` (default this rank's)."""
        return (self.replica if replica is None else replica) * self.size + local


def replica_config(config: ParallelConfig) -> ParallelConfig:
    """``config`` with one replica (DP 1): the layout each replica's world runs."""
    return dataclasses.replace(config, data_parallel_size=1)


def replica_place(rank: int, world_size: int, config: ParallelConfig) -> ReplicaPlace:
    """Rank ``rank``'s `ReplicaPlace` in a world of ``world_size`` laid out by ``config``;
    `ValueError` (naming the values) when the world does not match the config or the rank
    is outside it."""
    topo = plan_topology(world_size, config)
    coords = topo.coords(rank)
    size = config.ulysses_degree * config.cfg_parallel_size
    return ReplicaPlace(rank=rank, replica=coords.dp, replicas=config.data_parallel_size,
                        size=size)


def launch_store(rank: int, world_size: int, timeout: timedelta) -> Store:
    """This rank's client of the launch's c10d store, from torchrun's variables
    (MASTER_ADDR, MASTER_PORT; the store the launcher or torchrun's agent hosts when
    TORCHELASTIC_USE_AGENT_STORE is set, else rank 0 hosts it), as ``env://`` finds it.
    Every rank of the world calls it once at start."""
    import torch.distributed as dist

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"{name} is not set: launch the server's ranks with "
                             "`headmoe serve --nproc N` or torchrun")
    found = dist.rendezvous(  # type: ignore[attr-defined]
        "env://", rank=rank, world_size=world_size, timeout=timeout)
    store: Store = next(found)[0]
    store.set_timeout(timeout)
    return store


def serve_store(base: Store) -> Store:
    """The part of the launch store ``base`` the replicas share (prefix `SERVE_PREFIX`)."""
    import torch.distributed as dist

    return dist.PrefixStore(  # type: ignore[attr-defined]
        SERVE_PREFIX, base)


def join_replica(place: ReplicaPlace, base: Store, config: ParallelConfig,
                 timeout: timedelta) -> ParallelContext:
    """Join replica ``place.replica``'s own world (``place.size`` ranks, its default
    process group on the prefix `REPLICA_PREFIX` of ``base``) and create the groups of
    `replica_config` (``config`` with DP 1) in it; every rank of the replica calls it."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(  # type: ignore[attr-defined]
        REPLICA_PREFIX.format(place.replica), base)
    return ParallelContext.initialize(replica_config(config), rank=place.local_rank,
                                      world_size=place.size, store=prefixed, timeout=timeout)
