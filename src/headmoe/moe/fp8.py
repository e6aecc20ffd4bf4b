"""The FP8 E4M3 rule of the routed experts' weights (the one home of it; docs/fp8.md).

Layout: headmoe's expert tensors are `[h*E, in, out]` (the GEMM is `x @ W[r]`):
`W_gate`, `W_up` `[h*E, d, d_expert]`, `W_down` `[h*E, d_expert, d]`. An *output channel*
is one column of a (head, expert) block, the GEMM's output feature: the last dim. Each
(head, expert) row r and output channel c has one fp32 scale, so a weight `[R, K, N]`
becomes `float8_e4m3fn` values `[R, K, N]` (same layout) plus a scale `[R, N]` fp32.

The rule, for a weight w (bf16, fp16 or fp32; widened to fp32 exactly):

- `amax[r, c] = max_k |w[r, k, c]|` (fp32), `scale = amax / FP8_MAX` (fp32 division,
  FP8_MAX = 448 = `torch.finfo(torch.float8_e4m3fn).max`); an all-zero channel gets
  scale 1 (its values quantize to zeros either way; 1 keeps dequantization a plain
  product and the rule exact on re-quantization).
- `q = e4m3(clamp(w / scale, -448, 448))`: the fp32 quotient rounded to the nearest
  `float8_e4m3fn`, ties to even. Measured with torch 2.13.0+cpu: `Tensor.to(
  torch.float8_e4m3fn)` rounds to nearest even (1 + 1/16 -> 1, 1 + 3/16 -> 1.25,
  2**-10 -> 0, 3 * 2**-10 -> 2**-8) and saturates (449, 480, 1e4 and even inf give
  448; NaN stays NaN). The quotient of a channel's amax is within 1 ulp of 448, so the
  clamp only pins that rounding; it also keeps the rule independent of saturation.
- `dequantize(q, scale) = q.to(fp32) * scale` (one fp32 product per weight; computed
  through fp16 bits with the same values, see `dequantize`).
- Exact re-quantization: quantizing `dequantize(q, scale)` gives back the same fp8 bytes
  and scales (checked for every fp32 amax mantissa in tests/moe/test_fp8.py).
- NaN and Inf weights are refused with the tensor's name; so is a channel whose scale
  would not be a normal fp32 number (amax below 448 * 2**-126: no released weight).

Each (head, expert) row quantizes from its own values only, so a rank's head shard gives
the same bytes wherever it lives (EP layouts agree in FP8 as in bf16).
"""

from __future__ import annotations

import dataclasses

import torch

#: the storage dtype of FP8 expert weights
FP8_DTYPE = torch.float8_e4m3fn
#: the largest finite E4M3 value (448): a channel's amax maps to it
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: the dtypes a weight may be quantized from
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the scale of an all-zero output channel
ZERO_CHANNEL_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """One expert weight in FP8: `data` `[R, K, N]` float8_e4m3fn (R = h*E rows, K the
    GEMM's reduction dim, N its output channels) and `scale` `[R, N]` fp32, one per (row,
    output channel). Made by `quantize` (never NaN bytes) or from stored tensors, whose
    loader calls `check_fp8_bytes` once; construction checks shapes and dtypes only (cheap:
    an experts call may wrap a layer's tensors in one each forward)."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        check_fp8_weight("Fp8Weight", self.data, self.scale)

    @property
    def shape(self) -> torch.Size:
        """`[R, K, N]`, the shape of the bf16 weight it stands for."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows `[start, stop)` (default all) as fp32 `[stop - start, K, N]`."""
        return dequantize(self.data[start:stop], self.scale[start:stop])

    def to(self, device: torch.device | str) -> Fp8Weight:
        """The same weight on `device` (bytes unchanged)."""
        return Fp8Weight(self.data.to(device), self.scale.to(device))


def check_fp8_weight(name: str, data: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError naming `name` unless data is `[R, K, N]` float8_e4m3fn and scale `[R, N]`
    fp32 on data's device."""
    if not isinstance(data, torch.Tensor) or data.dtype != FP8_DTYPE or data.dim() != 3:
        got = _describe(data)
        raise ValueError(f"{name}: data must be a 3-d {FP8_DTYPE} tensor [R, K, N], got {got}")
    r, _, n = data.shape
    if (
        not isinstance(scale, torch.Tensor)
        or scale.dtype != torch.float32
        or tuple(scale.shape) != (r, n)
        or scale.device != data.device
    ):
        raise ValueError(f"{name}: scale must be fp32 [{r}, {n}] on {data.device}, got "
                         f"{_describe(scale)}")  # fmt: skip


def fp8_nan(data: torch.Tensor) -> torch.Tensor:
    """Bool mask of the E4M3 NaN bytes (`s1111111`; E4M3 has no Inf) of float8_e4m3fn
    `data` (any shape); torch has no `isnan` for it."""
    return (data.view(torch.uint8) & 0x7F) == 0x7F


def check_fp8_bytes(name: str, data: torch.Tensor) -> None:
    """ValueError naming `name`, the count and the first index of E4M3 NaN bytes (`fp8_nan`)
    in data (float8_e4m3fn): for FP8 tensors read from a file. `quantize` never writes
    them; the kernels' bit widening (`triton_fp8_kernels`) assumes none."""
    nan = fp8_nan(data)
    if bool(nan.any()):
        first = tuple(int(i) for i in nan.nonzero()[0])
        raise ValueError(f"{name}: {int(nan.sum())} NaN byte(s) in FP8 data, the first at "
                         f"index {first}")  # fmt: skip


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__


def check_finite(name: str, w: torch.Tensor, row0: int = 0) -> None:
    """ValueError naming `name`, the count and the first index of NaN/Inf values of w (w's
    first index counted from `row0`: w may be rows of a larger tensor)."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        where = (first[0] + row0, *first[1:])
        raise ValueError(f"{name}: {int(bad.sum())} NaN/Inf value(s) (the first at index "
                         f"{where}: {float(w[first])}); FP8 quantization takes finite "
                         "weights only")  # fmt: skip


def _check_source(name: str, w: torch.Tensor) -> None:
    if (
        not isinstance(w, torch.Tensor)
        or w.dim() != 3
        or w.dtype not in SOURCE_DTYPES
        or w.shape[1] == 0
    ):
        raise ValueError(f"{name}: expected a 3-d tensor [R, K, N] (K > 0) of one of "
                         f"{SOURCE_DTYPES}, got {_describe(w)}")  # fmt: skip


def channel_scales(name: str, w: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """The fp32 scale `[R, N]` of each (row, output channel) of w `[R, K, N]`: amax / 448,
    1 for an all-zero channel. ValueError naming `name` (and rows counted from `row0`) for
    NaN/Inf, a dtype outside `SOURCE_DTYPES`, or a nonzero channel whose scale would not be
    a normal fp32."""
    _check_source(name, w)
    check_finite(name, w, row0)
    amax = w.float().abs().amax(dim=1)
    scale = amax / FP8_MAX
    tiny = (amax > 0) & (scale < torch.finfo(torch.float32).tiny)
    if bool(tiny.any()):
        r, c = (int(i) for i in tiny.nonzero()[0])
        raise ValueError(f"{name}: row {r + row0} channel {c} has amax "
                         f"{float(amax[r, c]):.3e}, too small for a normal fp32 scale")  # fmt: skip
    return torch.where(amax > 0, scale, ZERO_CHANNEL_SCALE)


#: `quantize` works through this many (head, expert) rows at a time (its fp32 temporaries
#: are ~2 x 16 x d x d_expert x 4 bytes, 42 MB at MAGI-2's sizes); rows are independent
QUANTIZE_ROWS = 16


def quantize(name: str, w: torch.Tensor) -> Fp8Weight:
    """w `[R, K, N]` (bf16/fp16/fp32, finite) -> `Fp8Weight` (data `[R, K, N]`
    float8_e4m3fn, scale `[R, N]` fp32) by the rule of this module, `QUANTIZE_ROWS` rows at
    a time (peak memory: the result plus small temporaries); `name` (the tensor's
    checkpoint name) is in every error."""
    _check_source(name, w)
    data = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((w.shape[0], w.shape[2]), dtype=torch.float32, device=w.device)
    for r0 in range(0, w.shape[0], QUANTIZE_ROWS):
        part = w[r0 : r0 + QUANTIZE_ROWS]
        s = scale[r0 : r0 + QUANTIZE_ROWS]
        s.copy_(channel_scales(name, part, r0))
        q = (part.float() / s[:, None, :]).clamp_(-FP8_MAX, FP8_MAX)
        data[r0 : r0 + QUANTIZE_ROWS] = q.to(FP8_DTYPE)
    return Fp8Weight(data, scale)


#: E4M3 bits shifted left by 7 are the fp16 of value/256 (exponent bias 7 vs 15)
_FP16_REBIAS = 2.0**8


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data `[R, K, N]` float8_e4m3fn, scale `[R, N]` fp32 -> fp32 `[R, K, N]`,
    `data.to(fp32) * scale` per output channel.

    Computed through fp16, with the same values: the byte `s eeee mmm` shifted into fp16's
    bits (sign to bit 15, `eeee mmm` to bits 13..7) is the fp16 `q / 256`, normal or
    subnormal, so `fp16 * (256 * scale)` is the product `q * scale` rounded once (256 *
    scale is exact). torch 2.13's CPU float8 -> fp32 conversion is scalar; this is ~5x
    faster (measured: 1.7 vs 8.9 ms for one MAGI-2 W_gate block, one thread). Equal bits
    for all 254 non-NaN bytes (tests/moe/test_fp8.py); NaN bytes: `check_fp8_bytes`."""
    check_fp8_weight("dequantize", data, scale)
    bits = data.view(torch.int8).to(torch.int16)  # sign-extended: bits 15..8 = the sign
    bits <<= 7
    bits &= -16385  # clear bit 14 (the sign's copy): fp16 exponent 0eeee
    return bits.view(torch.float16) * (scale * _FP16_REBIAS)[:, None, :]
