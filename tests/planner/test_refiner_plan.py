"""The refiner's planner against the release's own range statistics at 1080p (golden
`release.p1080`) and against the attention plan the model runs; `plan` prints it."""

import json

import pytest
import torch

from headmoe.cli.plan import main as plan_main
from headmoe.config import ParallelConfig
from headmoe.models.refiner import attention_plan, get_refiner_config, pack_refiner
from headmoe.planner.refiner import refiner_memory, refiner_work
from tests.models.refiner_golden import golden_config, golden_json


@pytest.mark.parametrize("lt", ["0", "128", "512", "1024"])
def test_1080p_attention_work_equals_the_release_builder(lt):
    p1080 = golden_json("cases.json")["release"]["p1080"]
    want = p1080["ranges_by_text_len"][lt]
    work = refiner_work(get_refiner_config("magi2-refiner"), tuple(p1080["video_thw"]), int(lt))
    assert work.video_tokens == p1080["video_tokens"] == 514_080
    assert work.video_pairs == want["video_video_pairs"]
    assert work.pairs == want["attended_pairs"]
    assert work.video_keys_per_query == pytest.approx(want["mean_video_keys_per_video_query"],
                                                      rel=1e-12)
    assert work.dense_fraction == pytest.approx(want["fraction_of_dense"], rel=1e-12)
    if lt == "512":  # REFINER.md section 10: 5.44 + 3.31 = 8.75 PFLOP per forward
        assert round(work.linear_flop / 1e15, 2) == 5.44
        assert round(work.attention_flop / 1e15, 2) == 3.31


@pytest.mark.parametrize("thw, lt", [((9, 5, 14), 6), ((26, 13, 2), 1), ((3, 4, 13), 4)])
def test_pairs_equal_the_models_attention_plan(thw, lt):
    cfg = golden_config()
    plan = attention_plan(pack_refiner(torch.zeros(48, *thw), torch.zeros(lt, 40), cfg))
    assert refiner_work(cfg, thw, lt).pairs == plan.pairs()


def test_memory_shrinks_with_sp_and_plan_prints_the_stage(capsys):
    cfg = get_refiner_config("magi2-refiner")
    one, eight = (refiner_memory(cfg, (63, 68, 120), 512, ParallelConfig(ulysses_degree=sp),
                                 torch.bfloat16) for sp in (1, 8))
    assert one.weights == eight.weights == 6_697_844_736 * 2 + 22_230_544 * 4
    assert eight.activations < one.activations / 4
    assert plan_main(["--world-size", "8", "--resolution", "1080p", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["refiner"]
    assert data["latent"] == [63, 68, 120] and data["refiner_width"] == 1920
    assert {(r["ulysses_degree"], r["cfg_parallel_size"]) for r in data["layouts"]} >= {(8, 1),
                                                                                      (4, 2)}
