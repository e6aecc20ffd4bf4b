"""Compile headmoe's Triton kernels for Hopper (sm_90a) without a GPU and report what ptxas
made of them: whether the MMA kernels use wgmma and TMA, registers per thread, spilled
bytes, shared memory. This is how the default tiles (docs/moe.md section 6) were chosen on
a machine without an accelerator; it says nothing about speed.

    PYTHONPATH=src python benchmarks/compile_check.py [--kernels gate_up,down,...]

Exit status 1 when a kernel spills registers or an MMA kernel compiles without wgmma.
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

from headmoe.layers.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from headmoe.layers.triton_attention import DEFAULT_ATTENTION_TILES as AT
from headmoe.moe.triton_moe import DEFAULT_TILES as MT
from headmoe.moe.triton_moe import ROUTE_BLOCK_K, ROUTE_BLOCK_M

#: MAGI-2 per-rank sizes: head dim, expert width, experts, top-k, attention head dim
D, F, E, K, HEAD_DIM = 256, 1280, 256, 6, 128


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _desc(rows: int, cols: int, block: list[int], dtype: torch.dtype = torch.bfloat16):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(_t(rows, cols, dtype=dtype), block)


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
        "gate_up": ("moe.gate_up_kernel", lambda: dict(
            z_ptr=_t(8), src_ptr=_t(8, dtype=i64), tile_group_ptr=_t(8, dtype=i32),
            tile_rows_ptr=_t(8, dtype=i32), wg_desc=_desc(2 * D, F, [MT.gate_k, MT.gate_n]),
            wu_desc=_desc(2 * D, F, [MT.gate_k, MT.gate_n]),
            h_desc=_desc(2 * MT.block_m, F, [MT.block_m, MT.gate_n]), groups=768),
            dict(D=D, LIMIT=SWIGLU_LIMIT, ALPHA=SWIGLU_ALPHA, PRECISION="tf32",
                 N_BLOCKS=-(-F // MT.gate_n), BLOCK_M=MT.block_m, BLOCK_N=MT.gate_n,
                 BLOCK_K=MT.gate_k), warps),
        "down": ("moe.down_kernel", lambda: dict(
            h_desc=_desc(2 * MT.block_m, F, [MT.block_m, MT.down_k]),
            wd_desc=_desc(2 * F, D, [MT.down_k, MT.down_n]),
            y_desc=_desc(2 * MT.block_m, D, [MT.block_m, MT.down_n], f32),
            tile_group_ptr=_t(8, dtype=i32), groups=768),
            dict(F=F, PRECISION="tf32", N_BLOCKS=-(-D // MT.down_n), BLOCK_M=MT.block_m,
                 BLOCK_N=MT.down_n, BLOCK_K=MT.down_k), warps),
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
    }  # fmt: skip


def compile_one(path: str, args: dict[str, Any], consts: dict[str, Any], opts: dict) -> dict:
    """Compile one kernel for sm_90a; returns wgmma/tma flags, registers, spills, smem."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from headmoe.layers import triton_attention_kernels
    from headmoe.moe import triton_moe_kernels

    module, name = path.split(".")
    fn = getattr({"moe": triton_moe_kernels, "attention": triton_attention_kernels}[module], name)
    sig = {a: "constexpr" if a in consts else mangle_type(args[a]) for a in fn.arg_names}
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    ptx = kernel.asm["ptx"]
    return {"wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "registers": int(regs.group(1)) if regs else -1,
            "spill_bytes": int(spills.group(1)) if spills else -1,
            "shared_bytes": kernel.metadata.shared}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    table = specs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(table),
                        help=f"comma-separated subset of {', '.join(table)}")  # fmt: skip
    args = parser.parse_args(argv)
    names = args.kernels.split(",")
    for name in names:
        if name not in table:
            raise ValueError(f"--kernels: unknown kernel {name!r}, expected one of {list(table)}")
    os.environ.pop("TRITON_INTERPRET", None)
    bad = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: ptxas runs and logs
        for name in names:
            path, make_args, consts, opts = table[name]
            r = compile_one(path, make_args(), consts, opts)
            print(f"{name:10s} wgmma={r['wgmma']!s:5s} tma={r['tma']!s:5s} "
                  f"registers={r['registers']:3d} spill_bytes={r['spill_bytes']:5d} "
                  f"shared={r['shared_bytes']:,}")  # fmt: skip
            if r["spill_bytes"] != 0 or (name not in ("route", "combine") and not r["wgmma"]):
                bad.append(name)
    if bad:
        print("spills or no wgmma: " + ", ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
