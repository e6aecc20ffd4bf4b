"""Layout independence of the MAGI-2 transformer over 4 Gloo ranks (bitwise).

One spawn runs six layouts (SP4 = EP4, SP4 EP2 with either exchange, SP4 EP1, SP2 x CFG2,
SP2 x DP2), fp32 and bf16, each loading the same tiny checkpoint; the reference is the
one-rank forward of the same request in this process.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.models.magi2 import (
    Magi2Transformer,
    get_config,
    load_checkpoint,
    sp_token_counts,
    write_random_checkpoint,
)
from headmoe.testing import run_ranks
from tests.models.common import make_request

TINY = get_config("tiny")
DTYPES = (torch.float32, torch.bfloat16)
LAYOUTS = {
    "SP4": ParallelConfig(ulysses_degree=4),
    "SP4-EP2-ep_group": ParallelConfig(ulysses_degree=4, enable_expert_parallel=True,
                                       expert_parallel_size=2, moe_exchange="ep_group"),
    "SP4-EP2-sp_group": ParallelConfig(ulysses_degree=4, enable_expert_parallel=True,
                                       expert_parallel_size=2, moe_exchange="sp_group"),
    "SP4-EP1": ParallelConfig(ulysses_degree=4, enable_expert_parallel=True,
                              expert_parallel_size=1),
    "SP2xCFG2": ParallelConfig(ulysses_degree=2, cfg_parallel_size=2),
    "SP2xDP2": ParallelConfig(ulysses_degree=2, data_parallel_size=2),
}
MOE_KEYS = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias_ema")


def requests():
    """The main request (L = 253: uneven over 2 and 4 ranks; at SP4 rank 2 holds 2 text tokens,
    at SP2 rank 1 holds 2 of branch 0's text tokens), a small one (L = 18: at SP4 rank 0
    holds one audio token) and one with a single video token per branch and no audio or text
    (L = 2: ranks without any token)."""
    return {
        "main": make_request(TINY, 11, (4, 4, 6), 25, (8, 3)),
        "small": make_request(TINY, 12, (1, 2, 2), 3, (2, 2)),
        "empty-ranks": make_request(TINY, 13, (1, 1, 1), 0, (0, 0)),
    }


def _as_numpy(outs):
    return [(o.video.numpy(), o.audio.numpy()) for o in outs]


def run_layouts(rank: int, world: int, path: str) -> dict:
    results = {}
    for name, pc in LAYOUTS.items():
        ctx = ParallelContext.initialize(pc)
        for dtype in DTYPES:
            model = Magi2Transformer(TINY, ctx, dtype=dtype)
            load_checkpoint(model, path)
            for rname, req in requests().items():
                if rname != "main" and dtype != torch.float32:
                    continue
                if pc.cfg_parallel_size == 2:
                    req = [req[ctx.coords.cfg]]
                ctx.counters.reset()
                results[name, dtype, rname] = _as_numpy(model(req))
                if rname == "main":
                    kinds = Counter(r.kind for r in ctx.counters.exchanges)
                    results[name, dtype, "counts"] = (dict(kinds), len(ctx.counters.moe_rows))
            if name in ("SP4", "SP4-EP2-ep_group") and dtype == torch.float32:
                sd = model.state_dict()
                results[name, "moe"] = {
                    k: sd[f"block.layers.3.mlp.moe_mlp.{k}"].float().numpy() for k in MOE_KEYS
                }
        ctx.destroy()
    return results


def test_request_shapes_are_uneven_with_few_tokens():
    reqs = requests()
    assert sum(b.video.shape[:3].numel() + b.audio.shape[0] + b.text.shape[0]
               for b in reqs["main"]) == 253
    assert sp_token_counts(253, 4) == (64, 63, 63, 63)  # rank 2 starts at 127: text 127, 128
    assert sp_token_counts(18, 4) == (5, 5, 4, 4)  # rank 0: video 0-3, audio 4
    assert sp_token_counts(2, 4) == (1, 1, 0, 0) and sp_token_counts(1, 2) == (1, 0)


@pytest.mark.multirank
def test_six_layouts_bit_identical(tmp_path):
    path = tmp_path / "tiny.safetensors"
    write_random_checkpoint(TINY, path, seed=5)
    refs = {}
    for dtype in DTYPES:
        model = Magi2Transformer(TINY, dtype=dtype)
        load_checkpoint(model, path)
        for rname, req in requests().items():
            refs[dtype, rname] = _as_numpy(model(req))
    out = run_ranks(run_layouts, 4, args=(str(path),), timeout=400)
    layers = TINY.num_layers
    for rank, res in enumerate(out):
        for name, pc in LAYOUTS.items():
            for dtype in DTYPES:
                for rname in requests():
                    if rname != "main" and dtype != torch.float32:
                        continue
                    ref = refs[dtype, rname]
                    if pc.cfg_parallel_size == 2:  # CFG rank c computes branch c alone
                        ref = [ref[rank // pc.ulysses_degree]]
                    got = res[name, dtype, rname]
                    assert len(got) == len(ref)
                    for (gv, ga), (rv, ra) in zip(got, ref):
                        assert torch.equal(torch.from_numpy(gv), torch.from_numpy(rv)), (
                            rank, name, dtype, rname, "video")
                        assert torch.equal(torch.from_numpy(ga), torch.from_numpy(ra)), (
                            rank, name, dtype, rname, "audio")
                # per forward: one fused Ulysses all-to-all in and one out per layer, the two
                # MoE all-to-alls per MoE layer (none at EP1 under "auto" = ep_group: the EP
                # group is the rank itself), one output gather; no size collectives
                moe = len(TINY.moe_layer_ids)
                kinds = {"ulysses_in": layers, "ulysses_out": layers, "sp_output_gather": 1}
                if name != "SP4-EP1":
                    kinds |= {"moe_scatter": moe, "moe_gather": moe}
                assert res[name, dtype, "counts"] == (kinds, moe), (rank, name)
    full = load_file(path)
    for name, ep in (("SP4", 4), ("SP4-EP2-ep_group", 2)):
        per = 12 // ep * TINY.moe_num_experts
        for rank, res in enumerate(out):
            e = rank % ep
            for k in MOE_KEYS:
                want = full[f"block.layers.3.mlp.moe_mlp.{k}"][e * per : (e + 1) * per].float()
                assert np.array_equal(res[name, "moe"][k], want.numpy()), (name, rank, k)
