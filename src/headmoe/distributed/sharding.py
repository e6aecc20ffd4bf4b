"""Who holds what: the one home of headmoe's sharding rules (pure arithmetic; no
torch.distributed, no tensors).

Notation (one SP group):

    SP        ranks of the group, SP coordinate s = 0 .. SP-1
    E         EP degree (divides SP); R = SP / E replicas (EP runs per SP group)
    H, h      MoE heads of the model; heads per EP rank h = ceil(H / E) (padded)
    X         experts per MoE head; checkpoint rows are ordered head * X + expert

| rule | function | used by |
|---|---|---|
| SP token split (balanced, contiguous) | `sp_token_counts`, `sp_rows` | model, planner |
| attention heads of an SP rank after Ulysses | `sp_heads`, `sp_kv_heads` | models, planner |
| EP coordinates of SP rank s: (s mod E, s div E) | `ep_coords` | topology |
| heads and checkpoint rows of an EP rank | `head_shard` -> `HeadShard` | MoE layer, loader, planner |
| replica parts of each rank's tokens | `replica_token_counts` | dispatch, exchange tests |
| the MoE exchange of one forward | `dispatch_plan` -> `DispatchPlan` | MoE layer, planner |

Worked example, SP8 with EP4 (12 heads, h = 3, R = 2): SP rank 5 is EP rank 1 of run 1; it
holds heads 3..5 (checkpoint rows 3X .. 6X); under the "ep_group" exchange it computes
those heads for every token of ranks 4..7, under "sp_group" for the second half of every
SP rank's tokens. With EP8, h = 2 and heads 12..15 are zero padding: ranks 6 and 7 hold no
real head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from headmoe.config import MOE_EXCHANGES, check_positive_int, is_int

REPLICA_POLICIES: tuple[str, ...] = ("run_totals", "balanced")


def check_index(name: str, value: object, size: int) -> int:
    """`value` if it is an int in [0, size), else `ValueError` naming `name`."""
    if not is_int(value) or not 0 <= value < size:
        raise ValueError(f"{name} must be an int in [0, {size}), got {value!r}")
    return value


def check_counts(name: str, counts: object) -> tuple[int, ...]:
    """`counts` if it is a non-empty tuple of non-negative ints, else `ValueError`."""
    if not isinstance(counts, tuple) or not counts:
        raise ValueError(f"{name} must be a non-empty tuple of ints, got {counts!r}")
    for i, c in enumerate(counts):
        if not is_int(c) or c < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative int, got {c!r}")
    return counts


def check_replicas(replicas: object, world: int) -> int:
    if not is_int(replicas) or replicas < 1 or world % replicas:
        raise ValueError(
            f"replicas must be a positive int dividing the group size {world}, got {replicas!r}"
        )
    return replicas


# ---------------------------------------------------------------------- SP tokens
def sp_token_counts(length: int, sp: int) -> tuple[int, ...]:
    """Balanced contiguous split of `length` tokens over `sp` ranks: the first `length % sp`
    ranks get one extra token. Identical on every rank."""
    base, extra = divmod(length, sp)
    return tuple(base + (1 if r < extra else 0) for r in range(sp))


def sp_rows(counts: tuple[int, ...], sp_rank: int) -> tuple[int, int]:
    """`(lo, hi)`: the global rows SP rank `sp_rank` holds under `counts`."""
    lo = sum(counts[:sp_rank])
    return lo, lo + counts[sp_rank]


# ---------------------------------------------------------------------- SP heads
def sp_heads(num_heads: int, sp: int, sp_rank: int = 0) -> tuple[int, int]:
    """`(first, count)`: after the Ulysses exchange SP rank `sp_rank` of `sp` attends heads
    `[first, first + count)`, `count = num_heads // sp` (the model configs check that `sp`
    divides the query heads)."""
    count = num_heads // sp
    return sp_rank * count, count


def sp_kv_heads(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """KV heads per SP rank in an exchange that carries KV heads (the refiner's): its own
    `num_kv_heads // sp` when `sp` divides them, else the KV heads are first repeated to
    `num_heads` (GQA) and each rank gets `num_heads // sp`."""
    if num_kv_heads % sp:
        return sp_heads(num_heads, sp)[1]
    return num_kv_heads // sp


# ---------------------------------------------------------------------- EP heads
def ep_coords(sp_rank: int, ep_size: int) -> tuple[int, int]:
    """`(ep_rank, ep_run)` of SP rank `sp_rank`: runs of `ep_size` consecutive SP ranks."""
    return sp_rank % ep_size, sp_rank // ep_size


@dataclass(frozen=True)
class HeadShard:
    """The MoE heads EP rank `ep_rank` of an EP group of `ep_size` holds.

    Padded heads `[first, first + per_rank)`; of those, `[first, stop)` are real (`stop <=
    num_heads`), the rest zero padding."""

    num_heads: int
    ep_size: int
    ep_rank: int

    @property
    def per_rank(self) -> int:
        """h = ceil(H / E)."""
        return -(-self.num_heads // self.ep_size)

    @property
    def padded_heads(self) -> int:
        return self.per_rank * self.ep_size

    @property
    def first(self) -> int:
        return min(self.ep_rank * self.per_rank, self.num_heads)

    @property
    def stop(self) -> int:
        return min((self.ep_rank + 1) * self.per_rank, self.num_heads)

    @property
    def real_heads(self) -> int:
        return self.stop - self.first

    def rows(self, num_experts: int) -> tuple[int, int, int]:
        """`(start, stop, local_rows)`: checkpoint rows `[start, stop)` (head * X + expert)
        fill the first rows of this rank's `local_rows = h * X`; the rest are zeros."""
        return self.first * num_experts, self.stop * num_experts, self.per_rank * num_experts

    def describe(self) -> str:
        return (f"EP rank {self.ep_rank}/{self.ep_size}: heads {self.first}..{self.stop - 1}"
                if self.real_heads else f"EP rank {self.ep_rank}/{self.ep_size}: padding only")


def head_shard(num_heads: int, ep_size: int, ep_rank: int) -> HeadShard:
    """Validated `HeadShard` (raises `ValueError` naming the field)."""
    check_positive_int("num_heads", num_heads)
    check_positive_int("ep_size", ep_size)
    check_index("ep_rank", ep_rank, ep_size)
    return HeadShard(num_heads, ep_size, ep_rank)


# ---------------------------------------------------------------------- replica parts
def replica_token_counts(
    token_counts: tuple[int, ...], replicas: int, policy: str = "run_totals"
) -> tuple[tuple[int, ...], ...]:
    """Cut every rank's tokens into `replicas` contiguous parts (the `replica_counts` of a
    `HeadLayout`). The owners of part p are ranks `[p*shards, (p+1)*shards)`, each receiving
    part p of every rank.

    - "run_totals": part p summed over ranks equals the tokens of EP run p (ranks
      `[p*shards, (p+1)*shards)`), so each owner computes as many rows as inside its run.
    - "balanced": the part totals differ by at most one token (leading parts get the extra).

    Both start from a balanced split of each rank (leading parts get the remainder) and move
    whole tokens between parts of one rank, leading ranks first, until the totals match.
    Pure, deterministic and cached. Raises `ValueError` for bad counts, a `replicas` that is
    not a positive int dividing the group size, or an unknown policy.
    """
    counts = check_counts("token_counts", token_counts)
    check_replicas(replicas, len(counts))
    if policy not in REPLICA_POLICIES:
        raise ValueError(f"policy must be one of {REPLICA_POLICIES}, got {policy!r}")
    return _replica_parts(counts, replicas, policy)


@lru_cache(maxsize=1024)
def _replica_parts(
    counts: tuple[int, ...], replicas: int, policy: str
) -> tuple[tuple[int, ...], ...]:
    shards = len(counts) // replicas
    total = sum(counts)
    if policy == "run_totals":
        target = [sum(counts[p * shards : (p + 1) * shards]) for p in range(replicas)]
    else:
        target = [total // replicas + (p < total % replicas) for p in range(replicas)]
    parts = [[n // replicas + (p < n % replicas) for p in range(replicas)] for n in counts]
    # need[p] > 0: part p is short of tokens; < 0: it has too many. Each move shrinks |need|
    # on both sides, so a surplus part only loses tokens; when a rank is done, every surplus
    # part is empty there, hence no surplus survives the last rank.
    need = [target[p] - sum(row[p] for row in parts) for p in range(replicas)]
    for row in parts:
        for src in range(replicas):
            for dst in range(replicas):
                if need[src] < 0 < need[dst]:
                    m = min(row[src], -need[src], need[dst])
                    row[src] -= m
                    row[dst] += m
                    need[src] += m
                    need[dst] -= m
    return tuple(tuple(row) for row in parts)


# ---------------------------------------------------------------------- exchange layouts
@dataclass(frozen=True)
class HeadLayout:
    """One head <-> token exchange over one process group, as pure data.

    `token_counts`: every group rank's token count in group-rank order (uneven and zero
    allowed). `rank`: this rank's index in the group. `replica_counts`: optionally, per rank,
    a tuple of R contiguous part sizes of its tokens (R divides the group size; build them
    with `replica_token_counts`). One part per rank is the same exchange as no parts.
    Construction validates everything and raises `ValueError` naming the field and value.
    """

    token_counts: tuple[int, ...]
    rank: int
    replica_counts: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        counts = check_counts("token_counts", self.token_counts)
        world = len(counts)
        if not is_int(self.rank) or not 0 <= self.rank < world:
            raise ValueError(f"rank must be an int in [0, {world}), got {self.rank!r}")
        parts = self.replica_counts
        if parts is None:
            return
        if not isinstance(parts, tuple) or len(parts) != world:
            raise ValueError(
                f"replica_counts must be a tuple of {world} tuples (one per rank), got {parts!r}"
            )
        for r, p in enumerate(parts):
            if not isinstance(p, tuple) or not p:
                raise ValueError(f"replica_counts[{r}] must be a non-empty tuple, got {p!r}")
            if len(p) != len(parts[0]):
                raise ValueError(
                    f"replica_counts[{r}] has {len(p)} parts but replica_counts[0] has "
                    f"{len(parts[0])}: {parts!r}"
                )
            check_counts(f"replica_counts[{r}]", p)
            if sum(p) != counts[r]:
                raise ValueError(
                    f"replica_counts[{r}]={p!r} sums to {sum(p)}, not token_counts[{r}]={counts[r]}"
                )
        if world % len(parts[0]):
            raise ValueError(
                f"replica_counts has {len(parts[0])} parts per rank, which does not divide the "
                f"group size {world}"
            )

    @property
    def world_size(self) -> int:
        return len(self.token_counts)

    @property
    def replicas(self) -> int:
        """R: parts per rank (1 without `replica_counts`)."""
        return 1 if self.replica_counts is None else len(self.replica_counts[0])

    @property
    def shards(self) -> int:
        """Head shards: `world_size // replicas`."""
        return self.world_size // self.replicas

    @property
    def part(self) -> int:
        """The part this rank owns of every rank's tokens: `rank // shards`."""
        return self.rank // self.shards

    @property
    def shard(self) -> int:
        """The head shard this rank owns: `rank % shards`."""
        return self.rank % self.shards

    @cached_property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, its R part sizes (`((n,), ...)` without replicas)."""
        if self.replica_counts is None:
            return tuple((n,) for n in self.token_counts)
        return self.replica_counts

    @property
    def local_tokens(self) -> int:
        return self.token_counts[self.rank]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def local_parts(self) -> tuple[int, ...]:
        """This rank's R part sizes."""
        return self.parts[self.rank]

    @cached_property
    def owned_counts(self) -> tuple[int, ...]:
        """Tokens this rank receives from (and returns to) each source rank, in rank order."""
        return tuple(p[self.part] for p in self.parts)

    @property
    def owned_tokens(self) -> int:
        return sum(self.owned_counts)

    @cached_property
    def send_counts(self) -> tuple[int, ...]:
        """Tokens this rank sends to each owner rank in `scatter_heads` (rank order)."""
        return tuple(self.local_parts[dst // self.shards] for dst in range(self.world_size))

    def moved_bytes(self, token_bytes: int, to_heads: bool) -> tuple[int, int]:
        """(bytes sent to, bytes received from) the *other* ranks by one exchange over this
        layout moving `token_bytes` per token and destination shard (`a * h * D * element
        size`); `to_heads`: token shards to head shards (`scatter_heads`, Ulysses in), else
        back. The one byte accounting of the exchanges (they record it, the planner
        predicts it)."""
        out = [n * token_bytes for n in self.send_counts]
        back = [n * token_bytes for n in self.owned_counts]
        sent, got = (out, back) if to_heads else (back, out)
        return sum(sent) - sent[self.rank], sum(got) - got[self.rank]



# ---------------------------------------------------------------------- MoE dispatch
def resolve_exchange(mode: str, sp_size: int, ep_size: int) -> str:
    """The dispatch group of a configured `moe_exchange` mode: "ep_group" or "sp_group".

    Without replicas (`ep_size == sp_size`) both groups are the same and the answer is
    "ep_group". "auto" is "ep_group": the replicated exchange moves (SP-1)/SP instead of
    (E-1)/E of the rows over more peers and measured slower, while the balanced SP split
    leaves EP runs within E tokens of each other (measurements in docs/moe.md)."""
    if mode not in MOE_EXCHANGES:
        raise ValueError(f"moe_exchange must be 'auto', 'ep_group' or 'sp_group', got {mode!r}")
    return "sp_group" if mode == "sp_group" and ep_size < sp_size else "ep_group"


@dataclass(frozen=True)
class DispatchPlan:
    """One MoE exchange: over the `axis` group ("ep" or "sp"), this rank's `rank` in it,
    every member's token counts in group order and (sp axis) each member's replica parts.
    `layout` is the exchange's `HeadLayout` (the one conversion); the head shard it delivers
    to this rank is the layout's `shard`."""

    axis: str
    token_counts: tuple[int, ...]
    rank: int
    replica_counts: tuple[tuple[int, ...], ...] | None

    @property
    def layout(self) -> HeadLayout:
        """The exchange's `HeadLayout` (validated)."""
        return HeadLayout(self.token_counts, self.rank, self.replica_counts)

    @property
    def delivered_shard(self) -> int:
        """The head shard this rank's exchanges deliver to it (`layout.shard`)."""
        return self.layout.shard


def dispatch_plan(
    mode: str, sp_counts: tuple[int, ...], sp_rank: int, ep_size: int, batch_invariant: bool
) -> DispatchPlan:
    """The MoE exchange of SP rank `sp_rank` under `sp_counts` (every SP rank's tokens).

    "ep" exchanges inside this rank's EP run; "sp" over the whole SP group with replica
    parts, "balanced" when the expert path is batch-invariant, else "run_totals" (falling
    back to the EP run when the runs hold different totals)."""
    sp = len(sp_counts)
    replicas = sp // ep_size
    ep_rank, run = ep_coords(sp_rank, ep_size)
    runs = [sp_counts[r * ep_size : (r + 1) * ep_size] for r in range(replicas)]
    if resolve_exchange(mode, sp, ep_size) == "sp_group" and (
        batch_invariant or len({sum(r) for r in runs}) == 1
    ):
        policy = "balanced" if batch_invariant else "run_totals"
        return DispatchPlan("sp", sp_counts, sp_rank,
                            replica_token_counts(sp_counts, replicas, policy))
    return DispatchPlan("ep", runs[run], ep_rank, None)
