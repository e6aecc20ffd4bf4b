"""Process groups of a `Topology`, held in an explicit context object.

There are no module-level process groups: code that communicates receives a
`ParallelContext` (or the group it needs) from its caller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from headmoe.config import ParallelConfig
from headmoe.distributed.counters import Counters
from headmoe.distributed.topology import AXES, Coords, Topology, plan_topology

if TYPE_CHECKING:
    from torch.distributed import Store  # type: ignore[attr-defined]

DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_backend() -> str:
    """NCCL when CUDA is available, Gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_device() -> torch.device:
    """The device a rank of this process runs on when nothing else decides: the current
    CUDA device where CUDA is available (where NCCL ranks run), else the CPU. One-rank
    `generate` and `serve` use it, so a single rank runs where launched ranks run."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: cgroup v2 CPU quota of this process's container: "<quota us> <period us>" or "max ..."
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity (``os.sched_getaffinity``), capped
    by a cgroup v2 CPU quota (``/sys/fs/cgroup/cpu.max``, containers), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def set_rank_threads(local_ranks: int) -> int:
    """On a CPU host, give this rank ``available_cores() // local_ranks`` torch threads (at
    least 1: the cores this process may run on, not the machine's), so the ranks of a node
    share them; returns the count. On CUDA nothing (0; the GPU does the work). The one home
    of this rule (one-rank and launched `generate` ranks and `serve` ranks call it)."""
    threads = rank_threads(local_ranks)
    if threads:
        torch.set_num_threads(threads)
    return threads


def rank_threads(local_ranks: int) -> int:
    """The torch threads `set_rank_threads` gives each of ``local_ranks`` ranks (0 on CUDA),
    without setting them (the start-up line prints it)."""
    if torch.cuda.is_available():
        return 0
    return max(1, available_cores() // max(1, local_ranks))


@dataclass
class ParallelContext:
    """This rank's view of a job: its topology, coordinates and process groups.

    Build it with `ParallelContext.initialize` (joins or creates the default group, then
    creates every axis group) or `ParallelContext.single` (one rank, no torch.distributed).
    Groups of a world of one rank are `None`. Call `destroy()` when done; a new context with
    another layout can then be built over the same default group.
    """

    topology: Topology
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    counters: Counters = field(default_factory=Counters)
    """This rank's MoE-row and exchange-byte counters (see `headmoe.distributed.counters`)."""
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    _owned: list[dist.ProcessGroup] = field(default_factory=list)
    _owns_default_group: bool = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls, config: ParallelConfig | None = None,
               device: torch.device | None = None) -> ParallelContext:
        """A one-rank context on ``device`` (default the CPU); every group is None and no
        collective is ever issued."""
        config = config or ParallelConfig()
        topo = plan_topology(1, config)
        return cls(topology=topo, rank=0, device=device or torch.device("cpu"),
                   _groups={a: None for a in AXES})

    @classmethod
    def initialize(
        cls,
        config: ParallelConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
        backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        device: torch.device | None = None,
        store: Store | None = None,
    ) -> ParallelContext:
        """Create the process groups of `config` on this rank.

        If the default group is already initialised it is used (and not destroyed by
        `destroy`). Otherwise it is initialised from the explicit `rank`, `world_size` and
        `init_method`, or over the c10d `store` (a data-parallel replica's world:
        `headmoe.distributed.replicas.join_replica`), or from torchrun's environment (RANK,
        WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The topology is validated *before* any group is created. Group creation
        is transactional: if one fails, all groups created so far (and a default group
        created here) are destroyed and the error propagates.

        Device: `device` if given; else, when this call creates an NCCL default group, the
        rank's own GPU `cuda:LOCAL_RANK` (torchrun's variable; `rank % device_count` without
        it), made current before the group exists, so that several ranks of a node never
        share GPU 0; else the current CUDA device (NCCL) or the CPU.
        """
        owns_default = False
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank = _env_int("RANK") if rank is None else rank
            world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        topo = plan_topology(world_size, config)
        topo.coords(rank)
        if not dist.is_initialized():
            device = _init_default_group(rank, world_size, init_method, backend, timeout, device,
                                         store)
            owns_default = True
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend() == "nccl"
                else torch.device("cpu")
            )
        ctx = cls(topology=topo, rank=rank, device=device, _owns_default_group=owns_default)
        try:
            ctx._create_groups(backend, timeout)
        except BaseException:
            ctx.destroy()
            raise
        return ctx

    def _create_groups(self, backend: str | None, timeout: timedelta) -> None:
        # Every rank creates every group in the same order (torch.distributed requires it);
        # axes with identical membership share one group object.
        by_members: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for axis in AXES:
            mine = None
            for members in self.topology.groups(axis):
                key = tuple(members)
                if key not in by_members:
                    if len(key) == 1:
                        by_members[key] = None
                    else:
                        group = dist.new_group(list(key), timeout=timeout, backend=backend)
                        self._owned.append(group)
                        by_members[key] = group
                if self.rank in key:
                    mine = by_members[key]
            self._groups[axis] = mine

    # ------------------------------------------------------------------ accessors
    @property
    def config(self) -> ParallelConfig:
        return self.topology.config

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def coords(self) -> Coords:
        return self.topology.coords(self.rank)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """This rank's process group of `axis` ("sp", "cfg", "dp", "ep"); None when the
        group has one rank."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        return self._groups[axis]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's `axis` group, in group-rank order."""
        return self.topology.group_of(axis, self.rank)

    def group_rank(self, axis: str) -> int:
        """This rank's index inside its `axis` group."""
        return self.group_ranks(axis).index(self.rank)

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Destroy the groups this context created (and the default group if it created it)."""
        while self._owned:
            group = self._owned.pop()
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass
        self._groups = {a: None for a in AXES}
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_default_group = False

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def local_cuda_index(rank: int, device_count: int) -> int:
    """This rank's GPU on its node: LOCAL_RANK when torchrun set it, else `rank %
    device_count`. Raises `ValueError` naming LOCAL_RANK when it is not below
    `device_count`."""
    if device_count < 1:
        raise ValueError(f"the NCCL backend needs a CUDA device, found {device_count}")
    if "LOCAL_RANK" not in os.environ:
        return rank % device_count
    local = _env_int("LOCAL_RANK")
    if not 0 <= local < device_count:
        raise ValueError(f"LOCAL_RANK={local} must be in [0, {device_count}) (CUDA devices)")
    return local


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"{name} is not set: pass rank/world_size explicitly or launch with torchrun"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def _init_default_group(rank: int, world_size: int, init_method: str | None,
                        backend: str | None, timeout: timedelta,
                        device: torch.device | None,
                        store: Store | None = None) -> torch.device | None:
    """Initialise the default group (NCCL ranks first make their own GPU current); returns
    the device the rank uses (None: decided after the group exists)."""
    chosen = backend or default_backend()
    if device is None and chosen == "nccl":
        device = torch.device("cuda", local_cuda_index(rank, torch.cuda.device_count()))
    if device is not None and device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if store is not None:
        dist.init_process_group(backend=chosen, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend=chosen, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=timeout)
    return device
