"""4 Gloo ranks: MultiHeadMoE under SP4 with EP 1, 2, 4 and both exchanges equals the
single-rank layer bit for bit; its only collectives are the two all-to-alls."""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.moe import MoEConfig, MultiHeadMoE, read_moe_rows
from headmoe.moe.checkpoint import MOE_ROW_TENSORS
from headmoe.moe.layer import moe_plan
from headmoe.testing import run_ranks
from tests.moe.common import full_state

HEADS, EXPERTS = 6, 8
CFG = MoEConfig(hidden_size=48, num_heads=HEADS, num_experts=EXPERTS, top_k=2,
                expert_intermediate_size=16, route_scale=4.9)
COUNTS = [(6, 6, 6, 6), (7, 6, 5, 6), (3, 0, 1, 6)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLLECTIVES = (
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list", "barrier",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv",
    "isend", "irecv", "batch_isend_irecv",
)


@contextmanager
def _recording(calls: list[str]):
    """Record the name of every torch.distributed collective called inside the block."""
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return recorded

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _layer(cfg, ctx, path, full_load):
    layer = MultiHeadMoE(cfg, ctx)
    if full_load:
        layer.load_state_dict(load_file(path))
    else:  # read only this rank's rows from the file
        ep, ep_rank = ctx.topology.expert_parallel_size, ctx.coords.ep
        with safe_open(path, "pt") as f:
            layer.load_state_dict(
                {n: read_moe_rows(f, n, HEADS, EXPERTS, ep, ep_rank) for n in MOE_ROW_TENSORS}
            )
    return layer


def _ranks_main(rank, world, path):
    x = torch.randn(24, CFG.hidden_size, generator=torch.Generator().manual_seed(11))
    refs = {}
    for name, dtype in DTYPES.items():
        cfg = MoEConfig(**{**CFG.__dict__, "dtype": dtype})
        single = _layer(cfg, None, path, full_load=True)
        for counts in COUNTS:
            refs[name, counts] = single(x[: sum(counts)].to(dtype))
    results = {}
    for ep in (1, 2, 4):
        for mode in ("ep_group", "sp_group"):
            pc = ParallelConfig(ulysses_degree=4, enable_expert_parallel=True,
                                expert_parallel_size=ep, moe_exchange=mode)
            ctx = ParallelContext.initialize(pc)
            for name, dtype in DTYPES.items():
                cfg = MoEConfig(**{**CFG.__dict__, "dtype": dtype})
                layer = _layer(cfg, ctx, path, full_load=mode == "ep_group")
                for counts in COUNTS:
                    start, n = sum(counts[:rank]), counts[rank]
                    ctx.counters.reset()
                    out = layer(x[start : start + n].to(dtype), moe_plan(ctx, counts))
                    same = torch.equal(out, refs[name, counts][start : start + n])
                    results[ep, mode, name, counts] = (same, list(ctx.counters.moe_rows))
            ctx.destroy()
    # collectives: SP4 EP2, both exchanges
    calls = {}
    for mode in ("ep_group", "sp_group"):
        pc = ParallelConfig(ulysses_degree=4, enable_expert_parallel=True,
                            expert_parallel_size=2, moe_exchange=mode)
        ctx = ParallelContext.initialize(pc)
        layer = _layer(CFG, ctx, path, full_load=True)
        counts = COUNTS[1]
        start, n = sum(counts[:rank]), counts[rank]
        mine = x[start : start + n]
        for case, tokens, arg in [("given", mine, counts), ("bad_len", mine, counts[:3]),
                                  ("bad_mine", mine[:-1], counts)]:
            calls[mode, case] = []
            try:
                with _recording(calls[mode, case]):
                    out = layer(tokens, moe_plan(ctx, arg))
            except ValueError as err:
                calls[mode, case].append(f"ValueError: {err}")
                continue
            calls[mode, case].append(torch.equal(out, refs["fp32", counts][start : start + n]))
        ctx.destroy()
    return results, calls


@pytest.mark.multirank
def test_moe_ep_layouts_equal_single_rank_bitwise(tmp_path):
    path = str(tmp_path / "moe.safetensors")
    save_file(full_state(CFG, seed=12), path)
    per_rank = run_ranks(_ranks_main, 4, args=(path,), timeout=300)
    results = [r[0] for r in per_rank]
    assert len(results[0]) == 3 * 2 * 2 * len(COUNTS)
    for key in results[0]:
        assert all(r[key][0] for r in results), (key, [r[key][0] for r in results])
        # every (token, real head) row computed exactly once in the SP group
        ep, _, _, counts = key
        assert sum(r[key][1][0] for r in results) == sum(counts) * HEADS, key
    # EP4 pads 6 heads to 8: the last rank owns only padding and computes nothing
    assert all(results[3][key][1] == [0] for key in results[3] if key[0] == 4)
    for rank, (_, calls) in enumerate(per_rank):
        for mode in ("ep_group", "sp_group"):
            assert calls[mode, "given"] == ["all_to_all_single", "all_to_all_single", True]
            assert calls[mode, "bad_len"][0].startswith("ValueError: token_counts must be")
            assert calls[mode, "bad_mine"][0].startswith(f"ValueError: token_counts[{rank}]")
