"""Compile headmoe's Triton kernels for Hopper (sm_90a) without a GPU and report what ptxas
made of them: whether the MMA kernels use wgmma and TMA, registers per thread, spilled
bytes, shared memory against the device limit (232,448 bytes per block on H100/H200),
and the 16-byte global loads in the PTX (the gate/up gather, `gate_up` against
`gate_up_offsets`). This is how the default tiles (docs/moe.md section 6) were chosen on
a machine without an accelerator; it says nothing about speed.

    PYTHONPATH=src python benchmarks/compile_check.py [--kernels gate_up,down,...]

Exit status 1, with a line naming each kernel on stderr, when a kernel spills registers,
needs more shared memory than the limit (it would fail at launch), or is an MMA kernel
compiled without wgmma. `benchmarks/gpu_check.py` runs the same check for the device it
runs on (`compile_one` with the device's capability and shared-memory limit).
Uses Triton's ahead-of-time API (`triton.compile` of an `ASTSource`) and its bundled ptxas.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from headmoe.layers import triton_attention, triton_dense
from headmoe.layers.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from headmoe.layers.triton_attention import DEFAULT_ATTENTION_TILES as AT
from headmoe.layers.triton_dense import DENSE_TILES, NORM_BLOCK, NORM_ROWS
from headmoe.layers.triton_range_attention import DEFAULT_RANGE_TILES as RT
from headmoe.layers.triton_runtime import descriptor, kernels
from headmoe.moe import triton_fp8, triton_moe
from headmoe.moe.fp8 import FP8_DTYPE
from headmoe.moe.triton_moe import DEFAULT_TILES as MT
from headmoe.moe.triton_moe import ROUTE_BLOCK_K, ROUTE_BLOCK_M

#: MAGI-2 per-rank sizes: head dim, expert width, experts, top-k, attention head dim,
#: hidden size
D, F, E, K, HEAD_DIM, HIDDEN = 256, 1280, 256, 6, 128, 3072
#: shared memory a block may use on sm_90 (H100/H200: 227 KiB, the opt-in maximum;
#: CUDA C Programming Guide, "Compute Capabilities", table of technical specifications)
SMEM_LIMIT = 232_448
#: kernel module of each spec's prefix
MODULES = {"moe": triton_moe.KERNELS, "attention": triton_attention.KERNELS,
           "dense": triton_dense.KERNELS,
           "range": "headmoe.layers.triton_range_attention_kernels",
           "fp8": triton_fp8.FP8_KERNELS}  # fmt: skip


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _desc(rows: int, cols: int, block: list[int], dtype: torch.dtype = torch.bfloat16):
    """A descriptor of an empty `[rows, cols]` tensor (compile-time arguments only)."""
    return descriptor(_t(rows, cols, dtype=dtype), block)


def specs() -> dict[str, tuple[str, Callable[[], dict[str, Any]], dict[str, Any], dict]]:
    """name -> (kernel attribute path, runtime args factory, constexprs, launch options)."""
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    warps = {"num_warps": MT.num_warps, "num_stages": MT.num_stages}
    return {
        "route": ("moe.route_kernel", lambda: dict(
            z_ptr=_t(8), gate_ptr=_t(8, dtype=f32), bias_ptr=_t(8, dtype=f32),
            ids_ptr=_t(8, dtype=i64), w_ptr=_t(8, dtype=f32), n_tokens=1000, stride_zt=768,
            stride_zh=256, route_scale=4.9, eps=1e-12),
            dict(H=3, E=E, D=D, TOP_K=K, BLOCK_M=ROUTE_BLOCK_M, BLOCK_E=E, BLOCK_K=ROUTE_BLOCK_K),
            {"num_warps": 8}),
        "gate_up": _gate_up(True, warps),
        "gate_up_offsets": _gate_up(False, warps),
        "down": ("moe.down_kernel", lambda: dict(
            h_desc=_desc(2 * MT.block_m, F, [MT.block_m, MT.down_k]),
            wd_desc=_desc(2 * F, D, [MT.down_k, MT.down_n]),
            y_desc=_desc(2 * MT.block_m, D, [MT.block_m, MT.down_n], f32),
            tile_group_ptr=_t(8, dtype=i32), groups=768),
            dict(F=F, PRECISION="tf32", N_BLOCKS=-(-D // MT.down_n), BLOCK_M=MT.block_m,
                 BLOCK_N=MT.down_n, BLOCK_K=MT.down_k), warps),
        "expert_tile": ("moe.expert_tile_kernel", lambda: dict(
            z_ptr=_t(8), src_ptr=_t(8, dtype=i64), tile_group_ptr=_t(8, dtype=i32),
            tile_rows_ptr=_t(8, dtype=i32), wg_desc=_desc(2 * D, F, [MT.gate_k, MT.down_k]),
            wu_desc=_desc(2 * D, F, [MT.gate_k, MT.down_k]),
            wd_desc=_desc(2 * F, D, [MT.down_k, MT.down_n]),
            y_desc=_desc(2 * MT.fused_m, D, [MT.fused_m, MT.down_n], f32), groups=768,
            experts=E, stride_zt=3 * D, stride_zh=D),
            dict(D=D, F=F, LIMIT=SWIGLU_LIMIT, ALPHA=SWIGLU_ALPHA, PRECISION="tf32",
                 ROW_GATHER=True, N_BLOCKS=-(-D // MT.down_n), BLOCK_M=MT.fused_m,
                 BLOCK_N=MT.down_n, BLOCK_F=MT.down_k, BLOCK_K=MT.gate_k), warps),
        "gate_up_fp8": _gate_up_fp8(True, warps),
        "gate_up_fp8_bits": _gate_up_fp8(False, warps),
        "down_fp8": _down_fp8(True, warps),
        "down_fp8_bits": _down_fp8(False, warps),
        "combine": ("moe.combine_kernel", lambda: dict(
            y_ptr=_t(8, dtype=f32), pos_ptr=_t(8, dtype=i64), w_ptr=_t(8, dtype=f32),
            out_ptr=_t(8), n_rows=1000),
            dict(D=D, TOP_K=K, BLOCK_M=MT.combine_m, BLOCK_D=MT.combine_d),
            {"num_warps": MT.num_warps}),
        "attention": ("attention.sink_attention_kernel", lambda: dict(
            q_desc=_desc(1024, 3 * HEAD_DIM, [AT.block_m, HEAD_DIM]),
            k_desc=_desc(1024, 3 * HEAD_DIM, [AT.block_n, HEAD_DIM]),
            v_desc=_desc(1024, 3 * HEAD_DIM, [AT.block_n, HEAD_DIM]),
            o_desc=_desc(1024, 3 * HEAD_DIM, [AT.block_m, HEAD_DIM]),
            sinks_ptr=_t(8, dtype=f32), len_k=1000, qk_scale=0.1),
            dict(GROUP=1, HEAD_DIM=HEAD_DIM, PRECISION="tf32", BLOCK_M=AT.block_m,
                 BLOCK_N=AT.block_n),
            {"num_warps": AT.num_warps, "num_stages": AT.num_stages}),
        "range_attention": ("range.range_attention_kernel", lambda: dict(
            q_ptr=_t(8), k_ptr=_t(8), v_ptr=_t(8), o_ptr=_t(8), q_tiles_ptr=_t(8, dtype=i64),
            k_offsets_ptr=_t(8, dtype=i64), k_ranges_ptr=_t(8, dtype=i64),
            stride_qt=3 * HEAD_DIM, stride_qh=HEAD_DIM, stride_kt=3 * HEAD_DIM,
            stride_kh=HEAD_DIM, stride_vt=3 * HEAD_DIM, stride_vh=HEAD_DIM,
            stride_ot=3 * HEAD_DIM, stride_oh=HEAD_DIM, qk_scale=0.1),
            dict(GROUP=1, HEAD_DIM=HEAD_DIM, PRECISION="tf32", BLOCK_M=RT.block_m,
                 BLOCK_N=RT.block_n),
            {"num_warps": RT.num_warps, "num_stages": RT.num_stages}),
        "matmul": _matmul(torch.bfloat16),
        "matmul_fp32": _matmul(torch.float32),
        "linear_norm_swiglu": _linear(torch.bfloat16, norm=True, swiglu=True),
        "linear_gate_add": _linear(torch.float32, norm=False, swiglu=False),
        "rms_inv": ("dense.rms_inv_kernel", lambda: dict(
            x_ptr=_t(8), inv_ptr=_t(8, dtype=f32), R=1000, C=HIDDEN, stride_x=HIDDEN,
            eps=1e-6), dict(BLOCK_R=NORM_ROWS, BLOCK_C=NORM_BLOCK), {"num_warps": 8}),
        "rms_norm": ("dense.rms_norm_kernel", lambda: dict(
            x_ptr=_t(8), w_ptr=_t(8, dtype=f32), out_ptr=_t(8, dtype=f32), R=1000, C=HIDDEN,
            stride_x=HIDDEN, stride_w=0, stride_out=HIDDEN, eps=1e-6),
            dict(BLOCK_R=NORM_ROWS, BLOCK_C=NORM_BLOCK), {"num_warps": 8}),
    }  # fmt: skip


def _gate_up(row_gather: bool, warps: dict) -> tuple:
    """The gate/up kernel's spec with the row gather (production) or the offset gather."""
    i32, i64 = torch.int32, torch.int64
    return ("moe.gate_up_kernel", lambda: dict(
        z_ptr=_t(8), src_ptr=_t(8, dtype=i64), tile_group_ptr=_t(8, dtype=i32),
        tile_rows_ptr=_t(8, dtype=i32), wg_desc=_desc(2 * D, F, [MT.gate_k, MT.gate_n]),
        wu_desc=_desc(2 * D, F, [MT.gate_k, MT.gate_n]),
        h_desc=_desc(2 * MT.block_m, F, [MT.block_m, MT.gate_n]), groups=768, experts=E,
        stride_zt=3 * D, stride_zh=D),
        dict(D=D, LIMIT=SWIGLU_LIMIT, ALPHA=SWIGLU_ALPHA, PRECISION="tf32",
             ROW_GATHER=row_gather, N_BLOCKS=-(-F // MT.gate_n), BLOCK_M=MT.block_m,
             BLOCK_N=MT.gate_n, BLOCK_K=MT.gate_k), warps)  # fmt: skip


def _gate_up_fp8(native: bool, warps: dict) -> tuple:
    """The W8A16 gate/up kernel's spec: bf16 z, FP8 weights (float8_e4m3fn widened by the
    hardware if native, else uint8 bytes widened by bit operations), fp32 scales,
    production tiles."""
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    f8 = FP8_DTYPE if native else torch.uint8
    return ("fp8.gate_up_fp8_kernel", lambda: dict(
        z_ptr=_t(8), src_ptr=_t(8, dtype=i64), tile_group_ptr=_t(8, dtype=i32),
        tile_rows_ptr=_t(8, dtype=i32), wg_desc=_desc(2 * D, F, [MT.gate_k, MT.gate_n], f8),
        wu_desc=_desc(2 * D, F, [MT.gate_k, MT.gate_n], f8), sg_ptr=_t(8, dtype=f32),
        su_ptr=_t(8, dtype=f32), h_desc=_desc(2 * MT.block_m, F, [MT.block_m, MT.gate_n]),
        groups=768, experts=E, stride_zt=3 * D, stride_zh=D),
        dict(D=D, F=F, LIMIT=SWIGLU_LIMIT, ALPHA=SWIGLU_ALPHA, PRECISION="tf32",
             NATIVE=native, N_BLOCKS=-(-F // MT.gate_n), BLOCK_M=MT.block_m, BLOCK_N=MT.gate_n,
             BLOCK_K=MT.gate_k), warps)  # fmt: skip


def _down_fp8(native: bool, warps: dict) -> tuple:
    """The W8A16 down kernel's spec: bf16 hidden rows, FP8 W_down (as `_gate_up_fp8`),
    fp32 scales."""
    i32, f32 = torch.int32, torch.float32
    f8 = FP8_DTYPE if native else torch.uint8
    return ("fp8.down_fp8_kernel", lambda: dict(
        h_desc=_desc(2 * MT.block_m, F, [MT.block_m, MT.down_k]),
        wd_desc=_desc(2 * F, D, [MT.down_k, MT.down_n], f8), sd_ptr=_t(8, dtype=f32),
        y_desc=_desc(2 * MT.block_m, D, [MT.block_m, MT.down_n], f32),
        tile_group_ptr=_t(8, dtype=i32), groups=768),
        dict(F=F, D=D, PRECISION="tf32", NATIVE=native, N_BLOCKS=-(-D // MT.down_n), BLOCK_M=MT.block_m,
             BLOCK_N=MT.down_n, BLOCK_K=MT.down_k), warps)  # fmt: skip


def _matmul(dtype: torch.dtype) -> tuple:
    """The dense GEMM's spec with the production tiles of `dtype` (x `[M, C]` @ W^T)."""
    t = DENSE_TILES[dtype]
    return ("dense.matmul_kernel", lambda: dict(
        a_ptr=_t(8, dtype=dtype), b_ptr=_t(8, dtype=dtype), bias_ptr=_t(8, dtype=torch.float32),
        c_ptr=_t(8, dtype=dtype), M=1000, N=HIDDEN, K=HIDDEN, stride_ag=HIDDEN * 1024,
        stride_am=HIDDEN, stride_ak=1, stride_bg=0, stride_bk=1, stride_bn=HIDDEN,
        stride_cg=HIDDEN * 1024, stride_cm=HIDDEN, stride_cn=1),
        dict(HAS_BIAS=False, PRECISION="ieee" if dtype == torch.float32 else "tf32",
             BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m),
        {"num_warps": t.num_warps, "num_stages": t.num_stages})  # fmt: skip


def _linear(a_dtype: torch.dtype, norm: bool, swiglu: bool) -> tuple:
    """The fused layer linear's spec (bf16 weights, production tiles): a bf16 operand with
    the row gather, the RMSNorm prologue and the SwiGLU7 epilogue stored in bf16 (the
    multimodal MLP's up projection), or an fp32 operand with the per-head gate scale, cast
    in registers, with the bias and the fp32 add epilogue (the widest other variant)."""
    t, bf16, f32 = DENSE_TILES[torch.bfloat16], torch.bfloat16, torch.float32
    return ("dense.linear_kernel", lambda: dict(
        a_ptr=_t(8, dtype=a_dtype), idx_ptr=_t(8, dtype=torch.int64), inv_ptr=_t(8, dtype=f32),
        nw_ptr=_t(8, dtype=f32), b_ptr=_t(8, dtype=bf16), bias_ptr=_t(8, dtype=f32),
        add_ptr=_t(8, dtype=f32), c_ptr=_t(8, dtype=bf16 if swiglu else f32), M=1000,
        N=2 * HIDDEN, K=HIDDEN, stride_am=HIDDEN, stride_bk=1, stride_bn=HIDDEN,
        stride_sm=24, stride_dm=HIDDEN, stride_cm=HIDDEN),
        dict(GATHER=norm, NORM=norm, SCALE_DIV=0 if norm else HEAD_DIM, HAS_BIAS=not norm,
             SWIGLU=swiglu, ADD=not norm, LIMIT=SWIGLU_LIMIT,
             ALPHA=SWIGLU_ALPHA, PRECISION="tf32", BLOCK_M=t.block_m, BLOCK_N=t.block_n,
             BLOCK_K=t.block_k, GROUP_M=t.group_m),
        {"num_warps": t.num_warps, "num_stages": t.num_stages})  # fmt: skip


def signature(fn: Any, args: dict[str, Any], consts: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `fn` for `args`, specialised as a launch would be
    (triton's own rules: ints equal to 1 become constants; pointers and ints divisible by
    16 carry `tt.divisibility`, which is what lets a gather vectorise)."""
    from triton.backends.compiler import BaseBackend

    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:  # another triton: plain types, no divisibility hints
        from triton.runtime.jit import mangle_type

        def native_specialize_impl(_backend, arg, *_flags):
            return mangle_type(arg), None

    sig, constexprs, attrs = {}, dict(consts), {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        kind, attr = native_specialize_impl(BaseBackend, args[a], False, True, True)
        sig[a] = kind
        if kind == "constexpr":
            constexprs[a] = attr
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    return sig, constexprs, attrs


def compile_one(path: str, args: dict[str, Any], consts: dict[str, Any], opts: dict,
                capability: int = 90) -> dict:  # fmt: skip
    """Compile one kernel for `capability` (90: sm_90a) without launching it; returns
    wgmma/tma flags, registers, spills, shared bytes and 16-byte global loads in the PTX."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = path.split(".")
    fn = getattr(kernels(MODULES[module]), name)
    sig, constexprs, attrs = signature(fn, args, consts)
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", capability, 32), options=opts)  # fmt: skip
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    ptx = kernel.asm["ptx"]
    wide = len(re.findall(r"ld\.global[.\w]*\.v4\.b32|ld\.global[.\w]*\.v2\.b64|"
                          r"cp\.async\.c[ag]\.shared\.global[^;]*, (?:16|0x10)[,;]", ptx))  # fmt: skip
    return {"wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "registers": int(regs.group(1)) if regs else -1,
            "spill_bytes": int(spills.group(1)) if spills else -1,
            "shared_bytes": kernel.metadata.shared, "wide_loads": wide}  # fmt: skip


def problems(name: str, r: dict, smem_limit: int) -> list[str]:
    """What is wrong with compile result `r` of kernel `name`: spills, shared memory over
    `smem_limit` bytes (the launch would fail), an MMA kernel without wgmma."""
    out = []
    if r["spill_bytes"] != 0:
        out.append(f"{name}: {r['spill_bytes']} bytes of register spills")
    if r["shared_bytes"] > smem_limit:
        out.append(f"{name}: needs {r['shared_bytes']:,} bytes of shared memory, over the "
                   f"device limit of {smem_limit:,} bytes: it would fail at launch")  # fmt: skip
    if name not in NO_MMA and not r["wgmma"]:
        out.append(f"{name}: compiled without wgmma")
    return out


#: kernels without a tensor-core product
NO_MMA = ("route", "combine", "rms_norm", "rms_inv", "matmul_fp32")


def check_all(names: list[str], capability: int = 90, smem_limit: int = SMEM_LIMIT,
              report: Callable[[str, dict, int], None] | None = None) -> list[str]:  # fmt: skip
    """Compile `names` in a fresh cache (so ptxas runs and logs); every problem found, as
    text. `report(name, result, smem_limit)` sees each result (default: a line on stdout)."""
    table, found = specs(), []
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            for name in names:
                path, make_args, consts, opts = table[name]
                r = compile_one(path, make_args(), consts, opts, capability)
                (report or print_result)(name, r, smem_limit)
                found += problems(name, r, smem_limit)
        finally:
            os.environ.pop("TRITON_CACHE_DIR") if old is None else os.environ.update(
                TRITON_CACHE_DIR=old)  # fmt: skip
    return found


def print_result(name: str, r: dict, smem_limit: int) -> None:
    """One line per kernel: flags, registers, spills, shared memory / limit, wide loads."""
    print(f"{name:16s} wgmma={r['wgmma']!s:5s} tma={r['tma']!s:5s} "
          f"registers={r['registers']:3d} spill_bytes={r['spill_bytes']:5d} "
          f"shared={r['shared_bytes']:,}/{smem_limit:,} 16B_loads={r['wide_loads']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    table = specs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(table),
                        help=f"comma-separated subset of {', '.join(table)}")  # fmt: skip
    parser.add_argument("--smem-limit", type=int, default=SMEM_LIMIT,
                        help="shared memory per block of the target device, bytes")  # fmt: skip
    parser.add_argument("--capability", type=int, default=90,
                        help="CUDA compute capability to compile for, e.g. 90 (sm_90a)")
    args = parser.parse_args(argv)
    names = args.kernels.split(",")
    for name in names:
        if name not in table:
            raise ValueError(f"--kernels: unknown kernel {name!r}, expected one of {list(table)}")
    os.environ.pop("TRITON_INTERPRET", None)
    found = check_all(names, args.capability, args.smem_limit)
    for line in found:
        print("compile_check FAILED: " + line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
