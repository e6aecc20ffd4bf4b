"""Which rows of the full (head, expert)-ordered MoE tensors an EP rank holds.

Which heads an EP rank owns is `headmoe.distributed.sharding.head_shard`; its local tensors
have `h*E` rows: the full tensor's rows of its real heads first, then zero rows.
"""

from __future__ import annotations

from typing import Any

import torch

from headmoe.config import check_positive_int
from headmoe.distributed.sharding import head_shard
from headmoe.moe.weights import Bf16Experts

#: the router's tensors with (head, expert) rows, by their name relative to the MoE module
ROUTER_ROW_TENSORS: tuple[str, ...] = ("gate", "router.expert_bias", "router.expert_bias_ema")


def row_tensors(expert_names: tuple[str, ...]) -> tuple[str, ...]:
    """Every MoE tensor with (head, expert) rows of a layer whose experts' format registers
    `expert_names` (`ExpertWeights.NAMES`), in registration order."""
    return (ROUTER_ROW_TENSORS[0], *expert_names, *ROUTER_ROW_TENSORS[1:])


#: MoE tensors with (head, expert) rows of the released format (`Bf16Experts`)
MOE_ROW_TENSORS: tuple[str, ...] = row_tensors(Bf16Experts.NAMES)


def moe_row_slice(
    num_heads: int, num_experts: int, ep_size: int, ep_rank: int
) -> tuple[int, int, int]:
    """`(start, stop, local_rows)` of EP rank `ep_rank`'s head shard (`head_shard(...).rows`,
    the one home of the rule): rows `[start, stop)` of a full `[num_heads*num_experts, ...]`
    tensor fill the first `stop - start` of its `local_rows` rows; the rest are zeros.

    Example, 3 heads x 2 experts: EP2 rank 1 -> (4, 6, 4); EP4 rank 3 -> (6, 6, 2)."""
    check_positive_int("num_experts", num_experts)
    return head_shard(num_heads, ep_size, ep_rank).rows(num_experts)


def fit_rows(
    name: str, tensor: torch.Tensor, start: int, stop: int, local_rows: int, full_rows: int
) -> torch.Tensor:
    """This rank's `[local_rows, ...]` tensor from a full `[full_rows, ...]` one (rows
    `[start, stop)` then zero rows) or an already local-shaped one (returned as is).

    Raises `ValueError` naming `name` and the shape when the row count is neither."""
    rows = tensor.shape[0] if tensor.dim() else -1
    if rows == local_rows:
        return tensor
    if rows != full_rows:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}: expected {full_rows} (full) or "
            f"{local_rows} (local) rows"
        )
    return pad_rows(tensor[start:stop], local_rows)


def pad_rows(rows: torch.Tensor, local_rows: int) -> torch.Tensor:
    """`rows` `[m, ...]` followed by zero rows up to `[local_rows, ...]` (same dtype)."""
    if rows.shape[0] == local_rows:
        return rows
    out = rows.new_zeros((local_rows, *rows.shape[1:]))
    out[: rows.shape[0]] = rows
    return out


def read_moe_rows(
    handle: Any, key: str, num_heads: int, num_experts: int, ep_size: int, ep_rank: int
) -> torch.Tensor:
    """Read only this EP rank's rows of the full tensor `key` from an open safetensors file
    (`safetensors.safe_open(path, "pt")`), zero-padded to the local row count.

    Returns `[local_rows, ...]` in the stored dtype; other ranks' rows are never read."""
    start, stop, local_rows = moe_row_slice(num_heads, num_experts, ep_size, ep_rank)
    part = handle.get_slice(key)
    shape = tuple(part.get_shape())
    if not shape or shape[0] != num_heads * num_experts:
        raise ValueError(
            f"{key} has shape {shape}: expected {num_heads * num_experts} rows "
            f"({num_heads} heads x {num_experts} experts)"
        )
    return pad_rows(part[start:stop], local_rows)
