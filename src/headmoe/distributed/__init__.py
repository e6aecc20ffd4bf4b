"""Rank topology, process groups and the exchanges that run over them."""

from headmoe.distributed.context import ParallelContext, default_backend
from headmoe.distributed.counters import Counters, ExchangeRecord
from headmoe.distributed.topology import AXES, Coords, Topology, plan_topology

__all__ = [
    "AXES",
    "Coords",
    "Counters",
    "ExchangeRecord",
    "ParallelContext",
    "Topology",
    "default_backend",
    "plan_topology",
]
