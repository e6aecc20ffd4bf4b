"""The block-sparse range attention Triton kernel under Triton's interpreter on CPU
tensors (fp32/fp16): against the CPU path within tolerance on a refiner block-grid plan
(ragged blocks, masked neighbours, text rows), GQA, and bitwise invariance of a head's
rows to the other heads of the call and to KV heads repeated for GQA."""

import pytest
import torch

from headmoe.layers.range_attention import RangePlan, range_attention_reference
from headmoe.layers.triton_range_attention import RangeTiles, triton_range_attention
from headmoe.models.refiner import Magi2RefinerConfig, attention_plan, pack_refiner
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: 2x2x2 blocks with radius 1 over a 5x3x6 latent: ragged far blocks, masked pairs on
#: every axis; 5 text rows; tiles of at most 8 video rows and 16 text rows
CONFIG = Magi2RefinerConfig(name="t", num_layers=1, multimodal_layers=(), hidden_size=64,
                            head_dim=16, num_query_groups=2, text_in_channels=8, block_t=2,
                            block_h=2, block_w=2, radius_t=1, radius_h=1, radius_w=1)
TILES = RangeTiles(block_m=16, block_n=16)
HQ, HKV, DIM, SCALE = 4, 2, 16, 0.3


def _plan():
    packed = pack_refiner(torch.zeros(48, 5, 3, 6), torch.zeros(5, 8), CONFIG)
    plan = attention_plan(packed, tail_tile_rows=16)
    plan.validate()
    return plan


def _qkv(n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, DIM, generator=g).to(dtype) for h in (HQ, HKV, HKV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_cpu_path(dtype):
    plan = _plan()
    q, k, v = _qkv(plan.num_tokens, 1, dtype)
    out = triton_range_attention(q, k, v, plan, SCALE, tiles=TILES)
    ref = range_attention_reference(q.float(), k.float(), v.float(), plan, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol)


def test_head_shards_and_repeated_kv_give_the_same_bits():
    """Ulysses SP hands a rank a slice of the heads (here query heads 2, 3 with KV head 1),
    or KV heads repeated per query head when the SP degree does not divide them."""
    plan = _plan()
    q, k, v = _qkv(plan.num_tokens, 2)
    full = triton_range_attention(q, k, v, plan, SCALE, tiles=TILES)
    shard = triton_range_attention(q[:, 2:], k[:, 1:], v[:, 1:], plan, SCALE, tiles=TILES)
    assert torch.equal(shard, full[:, 2:])
    rep = triton_range_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), plan,
                                 SCALE, tiles=TILES)
    assert torch.equal(rep, full)


def test_bad_arguments_are_named():
    plan = _plan()
    q, k, v = _qkv(plan.num_tokens, 3)
    n = plan.num_tokens
    one_tile = RangePlan(torch.tensor([[0, n]]), torch.tensor([0, 1]), torch.tensor([[0, n]]), n)
    with pytest.raises(ValueError, match=f"query tile of {n} rows, more than tiles.block_m=16"):
        triton_range_attention(q, k, v, one_tile, SCALE, tiles=TILES)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        triton_range_attention(q[:, :3], k, v, plan, SCALE, tiles=TILES)
