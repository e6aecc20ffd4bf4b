"""Position-independent activations (checked bitwise on this machine's kernels)."""

import pytest
import torch

from headmoe.layers.activations import sigmoid, sigmoid_, swiglu7, swiglu7_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_sigmoid_bits_do_not_depend_on_position(dtype, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = (torch.randn(70_001, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
        full = sigmoid(x)
        for n in [*range(1, 40), 1000, 40_001]:
            for off in (0, 3, 17):
                assert torch.equal(sigmoid(x[off : off + n]), full[off : off + n]), (n, off)
        assert torch.allclose(full.float(), torch.sigmoid(x.float()), rtol=1e-2, atol=1e-6)
    finally:
        torch.set_num_threads(old)


def test_swiglu7_formula():
    h = torch.tensor([[9.0, -1.0, 0.5, -9.0], [-2.0, 3.0, 10.0, 8.0]])
    out = swiglu7(h)
    for r in range(2):
        for j in range(2):
            # fused layout: gate = even columns, up = odd columns (MAGI2.md section 3)
            g = min(h[r, 2 * j].item(), 7.0)
            u = max(min(h[r, 2 * j + 1].item(), 7.0), -7.0)
            expect = g / (1 + torch.exp(torch.tensor(-1.702 * g)).item()) * (u + 1)
            assert out[r, j].item() == pytest.approx(expect, rel=1e-6)
    assert swiglu7(h.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_forms_give_the_same_bits(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5003, generator=g) * 6).to(dtype)
    assert torch.equal(sigmoid_(x.clone()), sigmoid(x))
    assert torch.equal(sigmoid(x), 1.0 / (1.0 + torch.exp(-x)))
    h = (torch.randn(37, 128, generator=g) * 5).to(dtype)
    kept = h.clone()
    out = swiglu7(h)
    assert torch.equal(h, kept)  # the fused form leaves its input alone
    gate, up = h.float()[:, 0::2], h.float()[:, 1::2]  # even = gate, odd = up
    assert torch.equal(swiglu7_(gate.clone(), up.clone()), out)
    assert torch.equal(
        out, gate.clamp(max=7.0) * sigmoid(1.702 * gate.clamp(max=7.0)) * (up.clamp(-7, 7) + 1)
    )
