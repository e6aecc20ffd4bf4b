"""The W8A16 MoE Triton kernels (`headmoe.moe.triton_fp8`) under Triton's interpreter on
CPU tensors (fp32/fp16 activations: the 3.9.0 interpreter mis-reads bf16): against the
CPU FP8 path, and bitwise batch invariance of every (token, head) row. Small shapes: the
interpreter is slow."""

import pytest
import torch

from headmoe.moe import route
from headmoe.moe.fp8 import quantize
from headmoe.moe.fp8_experts import experts_fp8
from headmoe.moe.triton_fp8 import experts_triton_fp8
from headmoe.moe.triton_moe import MoETiles
from tests.moe.test_compile_check import _compile_check
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: small tiles: groups span one to several tiles; f=48 and d=48 end mid-block
TILES = MoETiles(block_m=16, gate_n=32, gate_k=16, down_n=32, down_k=16, combine_m=16,
                 combine_d=32)  # fmt: skip
H, E, D, F, K = 2, 8, 48, 48, 2


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(H * E, D, F, generator=g) / D**0.5
    wu = torch.randn(H * E, D, F, generator=g) / D**0.5
    wd = torch.randn(H * E, F, D, generator=g) / F**0.5
    wd[3, :, 5] = 0  # an all-zero output channel (scale 1)
    return [quantize(name, w) for name, w in zip(("W_gate", "W_up", "W_down"), (wg, wu, wd))]


def _routed(n: int, seed: int, dtype=torch.float32):
    """z `[n, H, D]` and its routes; a skewed bias makes group sizes range widely."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, H, D, generator=g).to(dtype)
    gate = torch.randn(H * E, D, generator=g) / D**0.5
    ids, w = route(z, gate, torch.linspace(0.6, -0.6, E).repeat(H), K, 2.5)
    return z, ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8a16_experts_match_the_cpu_fp8_path(dtype):
    """Both E4M3 widenings (the hardware's conversion; bit operations on uint8 bytes)
    give the same bits, within 1e-5 (fp32) of the CPU FP8 path."""
    z, ids, w = _routed(60, seed=1, dtype=dtype)
    weights = _weights(2)
    out = experts_triton_fp8(z, ids, w, *weights, tiles=TILES, native=True)
    assert torch.equal(out, experts_triton_fp8(z, ids, w, *weights, tiles=TILES, native=False))
    ref = experts_fp8(z, ids, w, *weights)
    assert out.dtype == dtype and out.shape == z.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    rel = (out.double() - ref.double()).norm() / ref.double().norm()
    assert float(rel) <= tol
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max())


def test_w8a16_rows_are_batch_invariant():
    """Random sub-batches (in random order) and a concatenation give every row the bits
    of the full batch; sub-batches give groups of one row to several tiles."""
    z, ids, w = _routed(80, seed=3)
    weights = _weights(4)
    full = experts_triton_fp8(z, ids, w, *weights, tiles=TILES)
    g = torch.Generator().manual_seed(5)
    for n in (1, 7, 33):
        idx = torch.randperm(80, generator=g)[:n]
        got = experts_triton_fp8(z[idx], ids[idx], w[idx], *weights, tiles=TILES)
        assert torch.equal(got, full[idx]), n
    z2, ids2, w2 = _routed(10, seed=6)
    both = experts_triton_fp8(torch.cat([z2, z]), torch.cat([ids2, ids]), torch.cat([w2, w]),
                              *weights, tiles=TILES)  # fmt: skip
    assert torch.equal(both[10:], full)
    assert experts_triton_fp8(z[:0], ids[:0], w[:0], *weights, tiles=TILES).shape == (0, H, D)


def test_bad_w8a16_arguments_raise_value_errors_naming_the_field():
    z, ids, w = _routed(4, seed=7)
    wg, wu, wd = _weights(8)
    with pytest.raises(ValueError, match="experts must be int64"):
        experts_triton_fp8(z, ids.int(), w, wg, wu, wd, tiles=TILES)
    with pytest.raises(ValueError, match="w_down must be FP8"):
        narrow = quantize("W_down", torch.randn(H * E, F, 16))
        experts_triton_fp8(z, ids, w, wg, wu, narrow, tiles=TILES)
    with pytest.raises(ValueError, match="w_gate must be an Fp8Weight"):
        experts_triton_fp8(z, ids, w, wg.dequantize(), wu, wd, tiles=TILES)
    with pytest.raises(ValueError, match="gate_k"):
        experts_triton_fp8(z, ids, w, wg, wu, wd, tiles=MoETiles(gate_k=32))


def test_w8a16_kernels_compile_for_hopper_with_wgmma_and_no_spills():
    """benchmarks/compile_check.py (a fresh process, ptxas bundled with triton) at the
    production tiles and MAGI-2's per-rank shapes: wgmma, TMA, no spills, shared memory
    within the H100/H200 limit (the check exits 1 otherwise)."""
    names = ("gate_up_fp8", "gate_up_fp8_bits", "down_fp8", "down_fp8_bits")
    run = _compile_check("--kernels", ",".join(names))
    assert run.returncode == 0, run.stderr[-2000:]
    for name in names:
        line = next(x for x in run.stdout.splitlines() if x.startswith(name))
        assert "wgmma=True" in line and "tma=True" in line and "spill_bytes=    0" in line


def test_bit_widening_gives_every_e4m3_value():
    """All 254 non-NaN bytes (subnormals, -0 and +-448 included) widened by `_e4m3_bits`
    to fp32, fp16 and bf16 equal torch's float8_e4m3fn conversion, bit for bit."""
    import triton
    import triton.language as tl

    from headmoe.moe import triton_fp8_kernels

    # the interpreter resolves a kernel's callees in its module's globals, not closures
    globals()["_e4m3_bits"] = triton_fp8_kernels._e4m3_bits

    @triton.jit
    def widen(src_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        widened = _e4m3_bits(tl.load(src_ptr + i), out_ptr.dtype.element_ty)  # noqa: F821
        tl.store(out_ptr + i, widened)

    data = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0  # the two NaN bytes: refused by check_fp8_bytes
    expected = data.view(torch.float8_e4m3fn).float()
    for dtype in (torch.float32, torch.float16):  # (bf16: the interpreter mis-reads it)
        out = torch.empty(256, dtype=dtype)
        widen[(1,)](data, out, N=256)
        assert torch.equal(out.float(), expected), dtype
        assert torch.equal(out.float().signbit(), expected.signbit())  # -0 kept
