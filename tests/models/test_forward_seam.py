"""The parallel seam of a forward: no block's `forward` takes the `ParallelContext`, and the
refiner's declared schedule is what it executes and what the planner prices (one rank
here; tests/models/test_refiner_multirank.py checks SP4 and SP2 x CFG2)."""

import inspect

import pytest
import torch
from torch import nn

import headmoe.layers.attention
import headmoe.models.magi2.model
import headmoe.models.refiner.model
import headmoe.moe.layer
from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.counters import ExchangeRecord
from headmoe.distributed.schedule import Exchange
from headmoe.distributed.sharding import sp_heads, sp_kv_heads, sp_token_counts
from headmoe.distributed.topology import plan_topology
from headmoe.models.refiner import pack_refiner
from headmoe.models.refiner.schedule import refiner_schedule
from headmoe.planner.predict import refiner_counters
from tests.models.refiner_golden import golden_config, golden_model, load_case

MODULES = (headmoe.models.magi2.model, headmoe.models.refiner.model, headmoe.moe.layer,
           headmoe.layers.attention)


def test_no_forward_takes_the_parallel_context():
    checked = 0
    for module in MODULES:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if not issubclass(cls, nn.Module) or cls.__module__ != module.__name__:
                continue
            params = inspect.signature(cls.forward).parameters.values()
            assert all(p.name not in ("ctx", "context") for p in params), cls
            assert all("ParallelContext" not in str(p.annotation) for p in params), cls
            checked += 1
    assert checked >= 8


def test_sp_heads_is_the_one_rule():
    assert sp_heads(12, 4, 3) == (9, 3)
    assert sp_kv_heads(8, 2, 2) == 1  # SP divides the KV heads: its own
    assert sp_kv_heads(8, 2, 4) == 2  # else repeated to the query heads first


def _packed():
    case = load_case("forward_masked")
    return pack_refiner(case["in.video_latent"][0], case["in.text"][0], golden_config())


def test_one_rank_refiner_executes_its_empty_schedule():
    ctx = ParallelContext.single()
    packed = _packed()
    golden_model(torch.float32, context=ctx).forward_packed(packed)
    assert ctx.counters.exchanges == []
    assert refiner_counters(golden_config(), packed.num_tokens, ParallelConfig(), 0).exchanges == []


@pytest.mark.parametrize("sp", [2, 4])
def test_refiner_schedule_lists_two_exchanges_per_layer_and_the_gather(sp):
    cfg, packed = golden_config(), _packed()
    pc = ParallelConfig(ulysses_degree=sp)
    topo = plan_topology(sp, pc)
    counts = sp_token_counts(packed.num_tokens, sp)
    schedule = refiner_schedule(cfg, topo, topo.coords(1), counts)
    kinds = [c.kind for c in schedule.collectives]
    assert kinds == [Exchange.ULYSSES_IN, Exchange.ULYSSES_OUT] * cfg.num_layers + [
        Exchange.SP_OUTPUT_GATHER]
    fused = schedule.collectives[0].heads // sp
    hq = cfg.num_attention_heads
    assert fused == sp_heads(hq, sp)[1] + 2 * sp_kv_heads(hq, cfg.num_query_groups, sp)
    priced = refiner_counters(cfg, packed.num_tokens, pc, 1, torch.bfloat16).exchanges
    assert [r.kind for r in priced] == [str(k) for k in kinds]
    assert all(isinstance(r, ExchangeRecord) and r.bytes_sent > 0 for r in priced)
    with pytest.raises(RuntimeError, match="schedule has"):
        schedule.check_executed(priced[1:])
