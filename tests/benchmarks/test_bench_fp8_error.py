"""benchmarks/bench_fp8_error.py (issue 28 point 4): its quick mode runs one request with
bf16 and FP8 experts and its figures are consistent with what they measure."""

import math

import pytest

from benchmarks import bench_fp8_error


@pytest.fixture(scope="module")
def figures():
    return bench_fp8_error.measure(quick=True, steps=2, reps=1, seed=0, threads=1)


def test_quick_run_measures_the_fp8_error_layer_by_layer(figures):
    first, second = figures["layers"]
    # the first MoE layer sees the same input in both runs: its error is its own, its
    # routes are the same, and the second layer's routes change exactly as when only the
    # first layer is FP8
    assert first["run_rel_l2"] == first["own_rel_l2"] and first["topk_changed_in_fp8_run"] == 0
    assert first["next_topk_changed"] == second["topk_changed_in_fp8_run"]
    for layer in figures["layers"]:  # E4M3 keeps 4 significant bits: a few percent, not 0
        assert 0 < layer["own_rel_l2"] < 2 ** -3, layer
    assert "next_topk_changed" not in second


def test_quick_run_reports_media_and_step_times(figures):
    m = figures["media"]
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["video_latent_rel_l2"] > 0 and -1 <= m["video_latent_cosine"] < 1
    assert m["video_psnr_db"] > 0 and m["audio_latent_rel_l2"] > 0
    assert [len(t) for t in figures["step_s"].values()] == [1, 1]
    assert all(t > 0 for ts in figures["step_s"].values() for t in ts)
    text = bench_fp8_error.report(figures)
    assert "| 0 |" in text and "load " in text
