"""Planner arithmetic against hand-computed values (MAGI2.md numbers, docs/parallelism.md)."""

from __future__ import annotations

import json

import pytest
import torch

from headmoe.cli.plan import main
from headmoe.config import ParallelConfig
from headmoe.models.magi2.config import get_config
from headmoe.planner import (
    RequestShape,
    enumerate_layouts,
    forward_counters,
    layout_name,
    parse_layout,
    plan_layout,
    weight_bytes,
)

PREVIEW = get_config("magi2-preview")
TINY = get_config("tiny")
# 272p, 125 frames at 12.5 fps, 250 text tokens per branch: L = 2 * (14336 + 250 + 250)
P272 = RequestShape((32, 16, 28), 250, (250, 250))
L272 = 29_672


def test_request_from_media_matches_magi2_numbers():
    r = RequestShape.from_media(height=256, width=448, num_frames=125, fps=12.5,
                                text_tokens=250, uncond_text_tokens=250)
    assert r == P272 and r.video_tokens == 14_336 and r.branch_tokens(0) * 2 == L272
    tiny = RequestShape.from_media(height=64, width=96, num_frames=13, fps=12.5,
                                   text_tokens=5, uncond_text_tokens=1)
    assert (tiny.video_latent, tiny.audio_tokens) == ((4, 4, 6), 26)
    assert tiny.branch_tokens(0) == 96 + 26 + 5 and tiny.branch_tokens(1) == 96 + 26 + 1


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"height": 250}, "height"), ({"width": 0}, "width"), ({"num_frames": 0}, "num_frames"),
    ({"fps": 0.0}, "fps"), ({"text_tokens": -1}, "text_tokens"),
])
def test_request_rejects_bad_fields(kwargs, field):
    args = dict(height=64, width=96, num_frames=13, fps=12.5, text_tokens=5,
                uncond_text_tokens=1) | kwargs
    with pytest.raises(ValueError, match=field):
        RequestShape.from_media(**args)


def test_layout_names_round_trip_and_reject():
    assert parse_layout("sp4,ep2,sp_group") == ParallelConfig(
        ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=2,
        moe_exchange="sp_group")
    assert parse_layout("sp2,cfg2") == ParallelConfig(ulysses_degree=2, cfg_parallel_size=2)
    assert parse_layout("sp4,ep4") == ParallelConfig(ulysses_degree=4)
    for name in ("sp4", "sp4,ep2", "sp2,cfg2,dp2,ep1,ep_group", "sp8,ep4,sp_group"):
        assert layout_name(parse_layout(name)) == name
    for bad in ("", "sp0", "sp4,sp2", "tp2", "sp4,ep3", "sp4,fast"):
        with pytest.raises(ValueError):
            parse_layout(bad)


def test_enumerate_world_8():
    names = [layout_name(p) for p in enumerate_layouts(PREVIEW, 8)]
    expected = []
    for sp, cfgdp in ((8, [""]), (4, [",dp2", ",cfg2"]), (2, [",dp4", ",cfg2,dp2"]),
                      (1, [",dp8", ",cfg2,dp4"])):
        for extra in cfgdp:
            expected.append(f"sp{sp}{extra}")
            for ep in (4, 2, 1):
                if ep < sp:
                    expected += [f"sp{sp}{extra},ep{ep},{m}" for m in ("ep_group", "sp_group")]
    assert names == expected and len(names) == 25


def test_acceptance_ep4_is_three_quarters_of_ep8(capsys):
    assert main(["--model", "magi2-preview", "--world-size", "8", "--resolution", "272p",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sp8 = [x for x in out["layouts"] if (x["ulysses_degree"], x["cfg_parallel_size"]) == (8, 1)]
    rows = {(x["expert_parallel_size"], x["moe_exchange"]): x["busiest_moe_rows"] for x in sp8}
    # EP8: 2 heads (16 padded heads) x all L tokens; EP4: 3 heads x the L/2 tokens of a run
    assert rows[(8, "ep_group")] == 2 * L272 == 59_344
    assert rows[(4, "ep_group")] == rows[(4, "sp_group")] == 3 * L272 // 2 == 44_508
    assert rows[(4, "ep_group")] * 4 == rows[(8, "ep_group")] * 3
    keys = {"ulysses_degree", "cfg_parallel_size", "data_parallel_size", "expert_parallel_size",
            "moe_exchange", "moe_heads_per_rank", "padded_moe_heads", "busiest_moe_rows",
            "moe_bytes_sent_per_rank", "expert_weight_bytes_per_rank", "recommended"}
    assert all(keys <= set(x) for x in out["layouts"])
    assert sum(x["recommended"] for x in out["layouts"]) == 1
    ep8 = next(x for x in sp8 if x["expert_parallel_size"] == 8)
    assert (ep8["moe_heads_per_rank"], ep8["padded_moe_heads"]) == (2, 4)


def test_bytes_by_hand_sp8():
    # bf16 (2 bytes); L = 29,672 tokens over 8 ranks -> 3,709 each (even split)
    s, other = 3_709, L272 - 3_709
    p = plan_layout(PREVIEW, P272, parse_layout("sp8,ep4,ep_group"), torch.bfloat16)
    # Ulysses in: q,k,v of my tokens for the 21 heads of the 7 others (3 heads each, dim 128);
    # out: attention output of the other ranks' tokens for my 3 heads
    assert p.ulysses_bytes_sent_per_rank == s * 3 * 21 * 128 * 2 + other * 3 * 128 * 2
    # MoE EP4 inside a run of 4: scatter 9 of my 12 heads (width 256); gather my 3 heads of
    # the 3 other ranks' tokens
    assert p.moe_bytes_sent_per_rank == s * 9 * 256 * 2 + 3 * s * 3 * 256 * 2
    assert (p.moe_peers, p.ulysses_peers) == (3, 7)
    c = forward_counters(PREVIEW, P272, parse_layout("sp8,ep4,ep_group"), 5, torch.bfloat16)
    summary = c.summary()
    assert summary["moe_calls"] == 36 and summary["moe_rows_total"] == 36 * 3 * 4 * s
    assert summary["exchanges"]["ulysses_in"]["calls"] == 40
    # final output gather: fp32, padded to the largest shard, 64 channels, to 7 ranks
    assert summary["exchanges"]["sp_output_gather"]["bytes_sent"] == 7 * s * 64 * 4


def test_tiny_uneven_split_by_hand():
    # tiny, SP4 EP2 ep_group, fp32; CFG1: L = (96+26+8) + (96+26+1) = 253 -> 64, 63, 63, 63
    req = RequestShape((4, 4, 6), 26, (8, 1))
    par = parse_layout("sp4,ep2,ep_group")
    rows = [forward_counters(TINY, req, par, r).moe_rows[0] for r in range(4)]
    assert rows == [127 * 6, 127 * 6, 126 * 6, 126 * 6]  # 6 heads x tokens of the EP run
    c = forward_counters(TINY, req, par, 1)
    scatter = next(x for x in c.exchanges if x.kind == "moe_scatter")
    # rank 1 sends its 63 tokens' heads 0-5 (width 32) to rank 0, receives rank 0's 64
    assert (scatter.bytes_sent, scatter.bytes_received) == (63 * 6 * 32 * 4, 64 * 6 * 32 * 4)
    single = forward_counters(TINY, req, parse_layout("sp1"), 0)
    assert single.exchanges == [] and single.moe_rows == [253 * 12] * 2


def test_expert_weight_bytes_by_hand():
    # tiny MoE layer, fp32: 12 heads x 8 experts = 96 rows; gate [96, 32], W_gate/W_up
    # [96, 32, 64], W_down [96, 64, 32], two bias buffers [96]; two MoE layers
    per_row = (32 + 3 * 32 * 64 + 2) * 4
    assert weight_bytes(TINY, 1, 0, torch.float32)[0] == 2 * 96 * per_row
    # EP8: 16 padded heads, 2 per rank (16 rows), padding allocated as zeros
    assert weight_bytes(TINY, 8, 7, torch.float32)[0] == 2 * 16 * per_row
    # MAGI-2 Preview: ~114B parameters (fp32 -> 4 bytes each), ~108.7B of them experts
    expert, total = weight_bytes(PREVIEW, 1, 0, torch.float32)
    assert 113e9 < total / 4 < 115e9
    assert expert == 36 * 3072 * (256 + 3 * 256 * 1280 + 2) * 4


def test_fp8_expert_weight_bytes_by_hand():
    # FP8 experts: 1 byte per weight plus an fp32 scale per (row, output channel):
    # W_gate/W_up scales [rows, 64], W_down's [rows, 32]; router gate and biases unchanged
    per_row = (32 + 2) * 4 + 3 * 32 * 64 + (64 + 64 + 32) * 4
    assert weight_bytes(TINY, 1, 0, torch.float32, "fp8")[0] == 2 * 96 * per_row
    assert weight_bytes(TINY, 8, 7, torch.float32, "fp8")[0] == 2 * 16 * per_row
    bf16, fp8 = (weight_bytes(PREVIEW, 1, 0, torch.bfloat16, f) for f in ("bf16", "fp8"))
    d, f, rows = 256, 1280, 36 * 3072
    assert bf16[0] - fp8[0] == rows * (3 * d * f * 2 - 3 * d * f - (2 * f + d) * 4)
    assert bf16[1] - bf16[0] == fp8[1] - fp8[0]  # everything else keeps the model dtype


@pytest.mark.parametrize("height, width", [(256, 448), (512, 896)])
def test_fp8_plan_names_a_two_gpu_layout_bf16_cannot(height, width):
    from headmoe.planner import plan_world

    request = RequestShape.from_media(height=height, width=width, num_frames=125, fps=12.5,
                                      text_tokens=250, uncond_text_tokens=250)
    with pytest.raises(ValueError, match="fits no layout"):
        plan_world(PREVIEW, request, 2, torch.bfloat16, memory_bytes=80 << 30)
    plans, _ = plan_world(PREVIEW, request, 2, torch.bfloat16, memory_bytes=80 << 30,
                          experts="fp8")
    best = next(p for p in plans if p.recommended)
    assert best.name == "sp2" and best.expert_format == "fp8"
    bf16 = {p.name: p.weight_bytes_per_rank for p in plan_world(
        PREVIEW, request, 2, torch.bfloat16)[0]}
    for p in plans:  # 52.9% (EP1) and 55.0% (EP2) of bf16's bytes per rank
        assert 0.52 < p.weight_bytes_per_rank / bf16[p.name] < 0.56, p.name


def test_plan_cli_table_and_errors(capsys):
    assert main(["--model", "tiny", "--world-size", "4", "--height", "64", "--width", "96",
                 "--num-frames", "13", "--text-tokens", "8", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.count("**recommended**") == 1 and "Recommended: " in out
    assert main(["--world-size", "8", "--height", "250"]) == 2
    assert "height" in capsys.readouterr().err
    assert main(["--world-size", "8", "--memory-gib", "1"]) == 2
    assert "memory" in capsys.readouterr().err


def test_component_bytes_match_the_loaded_tiny_components(tmp_path, tiny_release_in):
    from headmoe.planner.components import component_bytes
    from headmoe.release import folder as release
    from headmoe.release import placement
    from headmoe.release.text_encoder import Qwen35TextEncoder

    folder = tiny_release_in(tmp_path)
    parts = component_bytes("tiny")
    assert component_bytes(str(folder)) == parts  # the folder's own configs agree

    def nbytes(m):
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    enc = Qwen35TextEncoder.from_folder(folder / "text_encoder", dtype=torch.float32)
    assert parts.text_encoder == nbytes(enc.model)  # first L - 2 layers, fp32
    from headmoe.distributed import ParallelContext

    ctx = ParallelContext.single()
    video = placement.output_video_decoder(ctx, release.find_release(folder))
    assert parts.video_decoder * 2 == nbytes(video.decoder.model)  # counted in bf16
    audio = placement.output_audio_decoder(ctx, release.find_release(folder))
    assert parts.audio_decoder == nbytes(audio.decoder.decoder)  # fp32, weight norm folded


def test_components_placed_per_node_and_output_rank():
    from headmoe.planner.components import ComponentBytes

    parts = ComponentBytes(text_encoder=1000, video_decoder=30, audio_decoder=7)
    par = ParallelConfig(ulysses_degree=2, data_parallel_size=2)  # writers: ranks 0 and 2
    plan = plan_layout(TINY, RequestShape((4, 4, 6), 26, (8, 1)), par, torch.float32,
                       parts, ranks_per_node=2)
    w = plan.weight_bytes_per_rank
    assert plan.device_bytes_per_rank == (w + 1037, w, w + 1037, w)
    one_node = plan_layout(TINY, RequestShape((4, 4, 6), 26, (8, 1)), par, torch.float32,
                           parts)
    assert one_node.device_bytes_per_rank == (w + 1037, w, w + 37, w)
    off = plan_layout(TINY, RequestShape((4, 4, 6), 26, (8, 1)), par, torch.float32, parts,
                      offload=True)
    assert off.device_bytes_per_rank == (w,) * 4 and off.busiest_rank_bytes == w
    assert plan.to_dict()["busiest_rank_bytes"] == w + 1037
