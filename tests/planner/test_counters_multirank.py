"""Prediction vs measurement: the tiny transformer on 4 ranks in several layouts; every
rank's counters after one forward equal the planner's prediction exactly (rows and bytes,
event by event, in call order)."""

from __future__ import annotations

import pytest
import torch

from headmoe.distributed.context import ParallelContext
from headmoe.models.magi2 import BranchInput, Magi2Transformer
from headmoe.models.magi2.config import get_config
from headmoe.planner import RequestShape, forward_counters, parse_layout, sequence_branches
from headmoe.testing import run_ranks

LAYOUTS = ("sp4", "sp4,ep2,ep_group", "sp4,ep2,sp_group", "sp2,cfg2", "sp4,ep1",
           "sp4,ep1,sp_group", "sp2,dp2,ep1")
# 96 video + 26 audio + 8 / 1 text tokens: CFG1 packs 253 tokens (uneven over 4 ranks),
# CFG2 runs 130 and 123
REQUEST = RequestShape((4, 4, 6), 26, (8, 1))


def _events(ctx: ParallelContext) -> tuple[list[int], list[tuple[str, int, int]]]:
    c = ctx.counters
    return list(c.moe_rows), [(e.kind, e.bytes_sent, e.bytes_received) for e in c.exchanges]


def measure(rank: int, world: int, layouts: tuple[str, ...], req: RequestShape) -> list:
    cfg = get_config("tiny")
    gen = torch.Generator().manual_seed(0)
    video = torch.randn((*req.video_latent, cfg.video_in_channels), generator=gen)
    audio = torch.randn((req.audio_tokens, cfg.audio_in_channels), generator=gen)
    texts = [torch.randn((n, cfg.text_in_channels), generator=gen) for n in req.text_tokens]
    out = []
    for name in layouts:
        parallel = parse_layout(name)
        ctx = ParallelContext.initialize(parallel)
        try:
            model = Magi2Transformer(cfg, ctx)
            branches = [BranchInput(video, audio, texts[b], 0.7, 0.3)
                        for b in sequence_branches(parallel, ctx.coords.cfg)]
            ctx.counters.reset()
            model(branches)
            out.append(_events(ctx))
        finally:
            ctx.destroy()
    return out


@pytest.mark.multirank
def test_counters_equal_prediction_on_4_ranks():
    measured = run_ranks(measure, 4, args=(LAYOUTS, REQUEST), timeout=300)
    tiny = get_config("tiny")
    for i, name in enumerate(LAYOUTS):
        for rank in range(4):
            c = forward_counters(tiny, REQUEST, parse_layout(name), rank, torch.float32)
            predicted = (c.moe_rows, [(e.kind, e.bytes_sent, e.bytes_received)
                                      for e in c.exchanges])
            assert measured[rank][i] == predicted, (name, rank)
    # the test exercises what it claims: MoE exchanges in both modes, Ulysses, real rows
    kinds = {k for per_rank in measured for rows, ev in per_rank for k, *_ in ev}
    assert kinds == {"ulysses_in", "ulysses_out", "moe_scatter", "moe_gather",
                     "sp_output_gather"}
    assert all(rows and min(rows) > 0 for per_rank in measured for rows, _ in per_rank)
