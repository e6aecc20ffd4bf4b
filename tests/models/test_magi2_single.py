"""Single-rank MAGI-2 transformer: forward, CFG packing, input checks, checkpoints."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext, plan_topology
from headmoe.models.magi2 import (
    BranchInput,
    Magi2Transformer,
    get_config,
    load_checkpoint,
    pack_branches,
    sp_token_counts,
    time_sinusoid,
    write_random_checkpoint,
)
from tests.models.common import SMALL, make_request

TINY = get_config("tiny")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    write_random_checkpoint(TINY, path, seed=3)
    return path


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    write_random_checkpoint(SMALL, path, seed=4)
    return path


def test_sp_token_counts_balanced_contiguous():
    assert sp_token_counts(10, 4) == (3, 3, 2, 2)
    assert sp_token_counts(3, 4) == (1, 1, 1, 0)
    assert sp_token_counts(8, 1) == (8,)


def test_time_sinusoid_and_coords():
    e = time_sinusoid(torch.tensor([500.0]), 64)[0]
    assert e.shape == (64,) and e.dtype == torch.float32
    assert e[0].item() == pytest.approx(math.cos(500.0), abs=1e-4)
    assert e[32 + 1].item() == pytest.approx(math.sin(500.0 * 10000 ** (-1 / 32)), abs=1e-4)
    br = make_request(TINY, 0, (2, 2, 3), 4, (2,))[0]
    p = pack_branches([br], TINY)
    c = p.coords
    assert c.shape == (12 + 4 + 2, 9) and p.x.shape == (18, TINY.max_in_channels)
    assert c[7].tolist() == [1, 0, 1, 2, 2, 3, 2, 2, 3]  # row-major (t, h, w), grid = ref
    assert c[12:16, 0].tolist() == [0, 1, 2, 3] and c[12, 3:].tolist() == [4, 1, 1, 1, 1, 1]
    assert c[16:, 0].tolist() == [-2, -1] and c[16, 3:].tolist() == [2, 1, 1, 1, 1, 1]
    assert p.modality.tolist() == [0] * 12 + [1] * 4 + [2] * 2
    assert p.cu_seqlens.tolist() == [0, 18]
    assert torch.equal(p.time_tokens[0], time_sinusoid(torch.tensor([800.0]))[0])
    assert torch.equal(p.time_tokens[-1], time_sinusoid(torch.tensor([0.0]))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_shapes_and_cfg_packing_is_per_segment(tiny_ckpt, dtype):
    model = Magi2Transformer(TINY, dtype=dtype)
    load_checkpoint(model, tiny_ckpt)
    req = make_request(TINY, 1, (2, 3, 4), 7, (5, 2))
    packed = model(req)
    for br, out in zip(req, packed):
        assert out.video.shape == br.video.shape and out.audio.shape == br.audio.shape
        assert out.video.dtype == torch.float32 and out.video.isfinite().all()
        assert out.video.std() > 0.1 and out.audio.std() > 0.1
    for b in range(2):
        alone = model([req[b]])[0]
        assert torch.equal(alone.video, packed[b].video)
        assert torch.equal(alone.audio, packed[b].audio)
    # the text of a branch reaches its own video, not the other branch's
    other = list(req)
    other[1] = BranchInput(req[1].video, req[1].audio, req[1].text + 1.0, 0.8, 0.35)
    moved = model(other)
    assert torch.equal(moved[0].video, packed[0].video)
    assert not torch.equal(moved[1].video, packed[1].video)
    assert model.context.counters.moe_rows  # MoE layers ran


def test_bad_inputs_name_the_field():
    model = Magi2Transformer(SMALL)
    good = make_request(SMALL, 0, (1, 2, 2), 3, (2,))[0]
    cases = [
        ([], "branches"),
        ([BranchInput(good.video[..., :5], good.audio, good.text, 0.5, 0.5)], r"branches\[0\].video"),
        ([BranchInput(good.video, good.audio.double(), good.text, 0.5, 0.5)], r"branches\[0\].audio"),
        ([good, BranchInput(good.video, good.audio, good.text[None], 0.5, 0.5)],
         r"branches\[1\].text"),
        ([BranchInput(good.video, good.audio, good.text, 1.5, 0.5)], "t_video"),
        ([BranchInput(good.video, good.audio, good.text, 0.5, float("nan"))], "t_audio"),
        ([BranchInput(good.video[:0], good.audio[:0], good.text[:0], 0.5, 0.5)], "no tokens"),
    ]
    for branches, field in cases:
        with pytest.raises(ValueError, match=field):
            model(branches)
    pc = ParallelConfig(cfg_parallel_size=2)
    ctx = ParallelContext(topology=plan_topology(2, pc), rank=0)
    with pytest.raises(ValueError, match="len\\(branches\\)=2"):
        Magi2Transformer(SMALL, ctx)([good, good])
    with pytest.raises(ValueError, match="dtype"):
        Magi2Transformer(TINY, dtype=torch.float16)


def test_checkpoint_round_trip_file_and_index(tmp_path, tiny_ckpt):
    full = load_file(tiny_ckpt)
    assert full["block.layers.2.mlp.moe_mlp.W_up"].dtype == torch.bfloat16
    assert full["block.layers.2.mlp.moe_mlp.gate"].dtype == torch.float32
    assert full["block.layers.0.attention.linear_qkv.weight"].dtype == torch.bfloat16
    assert full["pre_adapter.text_embedder.weight"].dtype == torch.float32
    index = tmp_path / "model.safetensors.index.json"
    write_random_checkpoint(TINY, index, seed=3, max_shard_bytes=4 << 20)
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:  # same seed, same values, whatever the sharding
        for k, v in load_file(tmp_path / f).items():
            assert torch.equal(v, full[k]), k
    assert set(weight_map) == set(full)
    other = tmp_path / "seed4.safetensors"
    write_random_checkpoint(TINY, other, seed=4)
    assert not torch.equal(load_file(other)["block.layers.0.attention.linear_qkv.weight"],
                           full["block.layers.0.attention.linear_qkv.weight"])
    for dtype, batch_bytes in ((torch.float32, 1 << 30), (torch.bfloat16, 1 << 30),
                               (torch.bfloat16, 1)):  # 1 byte: one tensor per batch
        model = Magi2Transformer(TINY, dtype=dtype)
        load_checkpoint(model, index, max_batch_bytes=batch_bytes)
        sd = model.state_dict()
        for k, v in full.items():
            if k.endswith("router.expert_bias"):
                continue  # replaced by the EMA bias on load (MAGI2.md section 5)
            assert torch.equal(sd[k], v.to(sd[k].dtype)), k
        assert sd["block.layers.0.attention.linear_qkv.weight"].dtype == dtype
        assert torch.equal(sd["block.layers.3.mlp.moe_mlp.router.expert_bias"],
                           full["block.layers.3.mlp.moe_mlp.router.expert_bias_ema"])


def test_checkpoint_errors_name_the_tensor(tmp_path, small_ckpt):
    full = load_file(small_ckpt)
    model = Magi2Transformer(SMALL)
    cases = {
        "missing": {k: v for k, v in full.items() if k != "block.layers.2.attention.sinks"},
        "unexpected": {**full, "block.layers.2.extra": torch.zeros(2)},
        "mis-shaped": {**full, "block.layers.2.mlp.moe_mlp.W_down": torch.zeros(96, 64, 31)},
    }
    names = {"missing": "block.layers.2.attention.sinks", "unexpected": "block.layers.2.extra",
             "mis-shaped": "block.layers.2.mlp.moe_mlp.W_down"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for kind, tensors in cases.items():
        path = tmp_path / f"{kind}.safetensors"
        save_file(tensors, path)
        with pytest.raises(ValueError, match=kind) as err:
            load_checkpoint(model, path, max_batch_bytes=1)
        assert names[kind] in str(err.value)
        # nothing was loaded: the checks read only the headers, before any batch
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), kind
    bad_index = tmp_path / "bad.safetensors.index.json"
    bad_index.write_text("{}")
    with pytest.raises(ValueError, match="weight_map"):
        load_checkpoint(model, bad_index)


def _moe_rows_expected(full: torch.Tensor, ep: int, e: int) -> torch.Tensor:
    """Rank e of an EP group of `ep` owns padded heads [e*h, (e+1)*h), h = ceil(12/ep), each
    head 8 expert rows; padded heads are zero rows (ARCHITECTURE.md section 2)."""
    h = -(-12 // ep)
    out = torch.zeros(h * 8, *full.shape[1:], dtype=full.dtype)
    for j, head in enumerate(range(e * h, (e + 1) * h)):
        if head < 12:
            out[j * 8 : (j + 1) * 8] = full[head * 8 : (head + 1) * 8]
    return out


@pytest.mark.parametrize("sp", [8, 4])
def test_moe_rows_per_ep_rank_without_collectives(small_ckpt, sp):
    """Loading never communicates, so every rank of SP8 (EP8: 12 heads pad to 16) and SP4 can
    be loaded here from a context without process groups."""
    full = load_file(small_ckpt)
    topo = plan_topology(sp, ParallelConfig(ulysses_degree=sp))
    for rank in range(sp):
        model = Magi2Transformer(SMALL, ParallelContext(topology=topo, rank=rank))
        load_checkpoint(model, small_ckpt)
        sd = model.state_dict()
        for name in ("gate", "W_gate", "W_up", "W_down", "router.expert_bias_ema"):
            key = f"block.layers.2.mlp.moe_mlp.{name}"
            want = _moe_rows_expected(full[key], sp, rank).to(sd[key].dtype)
            assert torch.equal(sd[key], want), (rank, name)
