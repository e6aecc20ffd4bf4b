"""RMSNorm with a delta weight, and the per-modality variant."""

import torch

from headmoe.layers.norms import ModalityRMSNorm, rms_norm


def test_rms_norm_formula_and_rows():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    w = torch.tensor([0.5, -0.5])
    out = rms_norm(x, w, eps=0.0)
    expect = torch.tensor([[3 / 12.5**0.5 * 1.5, 4 / 12.5**0.5 * 0.5], [1.5, -0.5]])
    assert torch.allclose(out, expect, rtol=1e-6)
    big = torch.randn(300, 384)
    wr = torch.randn(384)
    full = rms_norm(big, wr)
    for m in (1, 5, 17, 299):
        assert torch.equal(rms_norm(big[:m], wr), full[:m])


def test_modality_rms_norm_uses_each_rows_weight():
    norm = ModalityRMSNorm(3, 4)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(12.0))
    x = torch.randn(5, 4)
    mod = torch.tensor([2, 0, 1, 2, 0])
    out = norm(x, mod)
    for t in range(5):
        w = torch.arange(12.0)[4 * mod[t] : 4 * mod[t] + 4]
        assert torch.equal(out[t], rms_norm(x[t : t + 1], w)[0])
