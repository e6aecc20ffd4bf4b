"""`plan --offload-layers` (issue 20): MAGI-2 Preview on one and two 141 GB GPUs, with the
host memory and bytes per step it needs, by hand from the modules as built."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from headmoe.cli.plan import main
from headmoe.models.magi2 import get_config
from headmoe.planner.predict import layer_bytes, weight_bytes

PREVIEW = get_config("magi2-preview")
GIB = 1 << 30
H200_GIB = 141e9 / GIB  # 131.3


@pytest.fixture(scope="module")
def plans():
    out = {}
    for world in (1, 2):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["--model", "magi2-preview", "--world-size", str(world),
                         "--offload-layers", "--memory-gib", f"{H200_GIB:.1f}", "--json"]) == 0
        out[world] = json.loads(buf.getvalue())
    return out


def _layer_total(ep: int, rank: int) -> int:
    return sum(b for b, _ in layer_bytes(PREVIEW, ep, rank, torch.bfloat16))


def test_one_gpu_fits_with_host_memory_and_bytes_per_step(plans):
    (one,) = plans[1]["layouts"]
    s = one["streaming"]
    assert one["recommended"] and s["device_bytes_per_rank"] <= 141e9
    layers = _layer_total(1, 0)
    assert s["non_layer_bytes"] == weight_bytes(PREVIEW, 1, 0, torch.bfloat16)[1] - layers
    assert s["bytes_per_step"] == layers  # every layer once per step, 212 GiB
    assert s["in_flight_bytes"] == 2 * max(
        slot for _, slot in layer_bytes(PREVIEW, 1, 0, torch.bfloat16))
    # the page cache holds the streamed checkpoint bytes once, plus the pinned slots
    assert s["host_bytes_per_node"] == layers + s["pinned_bytes_per_rank"]
    assert s["step_time_lower_bound_s"] == pytest.approx(layers / 25e9)
    assert 0 < s["max_resident_layers"] < PREVIEW.num_layers


def test_two_gpus_fit_and_replicas_share_the_host_copy(plans):
    by_name = {p["layout"]: p for p in plans[2]["layouts"]}
    assert all(p["streaming"]["device_bytes_per_rank"] <= 141e9 for p in by_name.values())
    assert by_name["sp2"]["expert_parallel_size"] == 2 and by_name["sp2"]["recommended"]
    assert "fewest weight bytes streamed per rank per step (119.1 GB)" in plans[2][
        "recommendation"]
    ep2, cfg2 = by_name["sp2"]["streaming"], by_name["sp1,cfg2"]["streaming"]
    # EP cuts the stream like the resident shard: each rank moves its own experts only
    assert ep2["bytes_per_step"] == _layer_total(2, 0) < cfg2["bytes_per_step"]
    assert cfg2["bytes_per_step"] == _layer_total(1, 0)
    # one node: both EP2 ranks' rows together are the checkpoint once; CFG replicas share it
    page_cache = _layer_total(1, 0)
    assert ep2["host_bytes_per_node"] == page_cache + 2 * ep2["pinned_bytes_per_rank"]
    assert cfg2["host_bytes_per_node"] == page_cache + 2 * cfg2["pinned_bytes_per_rank"]
