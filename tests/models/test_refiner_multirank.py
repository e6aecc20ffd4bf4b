"""Layout independence of the refiner over 4 Gloo ranks (bitwise): one spawn runs SP4
(KV heads repeated: SP 4 does not divide the golden model's 2 KV heads) and SP2 x CFG2
(one KV head per rank, the two forwards of a step on two SP groups), fp32 and bf16
forwards and the refine stage (handoff, noise draw, 5 CFG steps); the reference is one
rank in this process. Each forward's executed collectives (kinds and bytes) equal the
planner's pricing of the refiner's declared schedule (`refiner_counters`)."""

import pytest
import torch

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.models.refiner import pack_refiner
from headmoe.pipeline.refine import refine_stage
from headmoe.pipeline.seeding import seeded_generator
from headmoe.planner.predict import refiner_counters
from headmoe.testing import run_ranks
from tests.models.refiner_golden import golden_config, golden_model, load_case

LAYOUTS = {
    "SP4": ParallelConfig(ulysses_degree=4),
    "SP2xCFG2": ParallelConfig(ulysses_degree=2, cfg_parallel_size=2),
}
DTYPES = (torch.float32, torch.bfloat16)


def _inputs():
    case = load_case("forward_masked")
    loop = load_case("refine_loop")
    preview = loop["in.preview_latent"][0].permute(1, 2, 3, 0).contiguous()
    return case, preview, [loop["in.context"][0], loop["in.context_null"][0]]


def _run(ctx: ParallelContext, scheduled: dict | None = None) -> dict:
    case, preview, texts = _inputs()
    packed = pack_refiner(case["in.video_latent"][0], case["in.text"][0], golden_config())
    out = {}
    for dtype in DTYPES:
        model = golden_model(dtype, context=ctx)
        ctx.counters.reset()
        out["forward", dtype] = model.forward_packed(packed)
        if scheduled is not None:  # executed == the priced schedule, bytes included
            want = refiner_counters(golden_config(), packed.num_tokens, ctx.config, ctx.rank,
                                    dtype).exchanges
            scheduled[dtype] = (ctx.counters.exchanges == want,
                                [r.kind for r in ctx.counters.exchanges])
        gen = seeded_generator(7)
        torch.randn(3, generator=gen)  # the preview's draws come first
        out["stage", dtype] = refine_stage(ctx, model, preview, texts, gen, 70, 215)[0]
    return out


def _worker(rank: int, world: int) -> dict:
    results, scheduled = {}, {}
    for name, pc in LAYOUTS.items():
        ctx = ParallelContext.initialize(pc)
        try:
            scheduled[name] = {}
            results[name] = {k: v.numpy() if v.dtype != torch.bfloat16 else v.float().numpy()
                             for k, v in _run(ctx, scheduled[name]).items()}
        finally:
            ctx.destroy()
    return results, scheduled


@pytest.mark.multirank
def test_layouts_give_the_bits_of_one_rank():
    ref = _run(ParallelContext.single())
    assert ref["stage", torch.float32].shape == (3, 4, 13, 48)
    per_rank = run_ranks(_worker, 4, timeout=300.0)
    layers = golden_config().num_layers
    for rank, (results, scheduled) in enumerate(per_rank):
        for name, by_dtype in scheduled.items():
            for dtype, (same, kinds) in by_dtype.items():
                assert same, (rank, name, dtype, kinds)
                assert kinds == ["ulysses_in", "ulysses_out"] * layers + ["sp_output_gather"]
        for name, got in results.items():
            for key, want in ref.items():
                assert torch.equal(torch.from_numpy(got[key]), want.float()), (rank, name, key)
