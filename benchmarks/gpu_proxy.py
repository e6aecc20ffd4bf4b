"""GPU proxy on the CPU (issue 30): what one transformer forward costs per rank on CUDA,
counted on the meta device, no GPU needed.

The real configuration (`magi2-preview`, bf16) is built on the meta device for rank 0 of
the layout, with the CUDA dispatch taken (`triton_runtime.use_triton` answers True): every
Triton kernel launch is recorded as one launch with its FLOPs and the bytes of its tensor
arguments (`KERNEL_COST`), every torch op (a `TorchDispatchMode`; views and allocations are
not launches) as one launch with the bytes of its inputs and outputs and the FLOPs of
`torch.utils.flop_counter` (elementwise: one per output element). Collectives (Ulysses,
MoE scatter / gather, output gather) are replaced by shape stand-ins and reported apart.
Layers of one kind (multimodal dense, MoE) have the same shapes, so one layer of each kind
is run and counted `layers of that kind` times.

Per forward (= one denoise step, both CFG branches packed) per rank: launches, FLOPs by
region (attention, linears, experts, mhc, other), HBM bytes, an H200 roofline time (each
launch `max(flops / 989e12, bytes / 4.8e12)`, summed; "elementwise" = the part of the time
spent in launches that are neither GEMMs nor attention), and the peak live activation
bytes (meta tensors alive at once, weights excluded) beside `headmoe plan`'s activation
estimate (`headmoe.planner.memory.estimate_memory`).

    python benchmarks/gpu_proxy.py             # 272p and 540p at SP1, SP4/EP2, SP8/EP4
    python benchmarks/gpu_proxy.py --quick     # 272p SP8/EP4 only (CI: tests/benchmarks)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import markdown_table  # noqa: E402
from headmoe.config import ParallelConfig  # noqa: E402
from headmoe.distributed.context import ParallelContext  # noqa: E402
from headmoe.distributed.topology import AXES, plan_topology  # noqa: E402
from headmoe.layers import triton_attention, triton_dense, triton_mhc, triton_runtime  # noqa: E402
from headmoe.models.magi2 import model as magi2_model  # noqa: E402
from headmoe.models.magi2.config import get_config  # noqa: E402
from headmoe.models.magi2.packing import BranchInput, pack_branches  # noqa: E402
from headmoe.moe import layer as moe_layer  # noqa: E402
from headmoe.moe import triton_moe  # noqa: E402
from headmoe.pipeline.recipe import RESOLUTIONS  # noqa: E402
from headmoe.planner.memory import estimate_memory  # noqa: E402
from headmoe.planner.request import RequestShape  # noqa: E402

#: H200 SXM dense bf16 peak and HBM3e bandwidth (NVIDIA H200 datasheet)
PEAK_FLOPS, HBM_BPS = 989e12, 4.8e12
#: (label, SP, EP) of the layouts in the table
LAYOUTS = (("SP1", 1, 1), ("SP4/EP2", 4, 2), ("SP8/EP4", 8, 4))
#: text tokens of the released recipe's branches (the planner's default)
TEXT_TOKENS = 250
GEMM_KERNELS = {"matmul_kernel", "rms_matmul_kernel", "gate_up_kernel", "down_kernel",
                "route_kernel", "linear_kernel", "expert_tile_kernel"}
ATTENTION_KERNELS = {"sink_attention_kernel", "range_attention_kernel"}
SKIP_OPS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like",
            "detach", "lift_fresh", "_unsafe_view"}  # fmt: skip


@dataclass
class Ledger:
    """What a forward launched: per (region, name) launches, FLOPs, bytes, roofline s."""

    rows: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0, 0.0, 0.0]))
    comm: Counter = field(default_factory=Counter)
    live: int = 0
    peak: int = 0
    region: list = field(default_factory=lambda: ["other"])

    def launch(self, name: str, flops: float, nbytes: float, gemm: bool = False) -> None:
        region = self.region[-1]
        if name in ATTENTION_KERNELS or region == "attention":
            region, gemm = "attention", True
        elif gemm and region == "other":
            region = "linears"
        row = self.rows[(region, name, gemm)]
        row[0] += 1
        row[1] += flops
        row[2] += nbytes
        row[3] += max(flops / PEAK_FLOPS, nbytes / HBM_BPS)

    def alloc(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class CountOps(TorchDispatchMode):
    """Records every torch op on meta tensors as one launch in `ledger`."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.is_view or name in SKIP_OPS or func._schema.name.startswith("aten::sym"):
            return out
        ins = {id(t): t for t in _tensors((args, kwargs))}
        outs = [t for t in _tensors(out) if id(t) not in ins]
        if name.startswith("empty") or name == "new_empty":
            return out
        for t in outs:
            self.ledger.alloc(t)
        nbytes = sum(map(_nbytes, ins.values())) + sum(map(_nbytes, outs))
        # imported here, not at module level: torch.utils.flop_counter imports triton, and a
        # test process must be able to set TRITON_INTERPRET after collecting this module
        from torch.utils.flop_counter import flop_registry

        packet = func._overloadpacket
        gemm = packet in flop_registry
        flops = (flop_registry[packet](*args, **kwargs, out_val=out) if gemm
                 else sum(t.numel() for t in _tensors(out)))  # fmt: skip
        self.ledger.launch(f"aten.{name}", flops, nbytes, gemm)
        return out


def _shape(t, dims: int) -> tuple[int, ...]:
    return tuple(t.shape[-dims:]) if isinstance(t, torch.Tensor) else ()


def _flops_matmul(a, b, *_r, **_k) -> float:
    g = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * g * a.shape[-2] * a.shape[-1] * b.shape[-1]


def _flops_rms_matmul(a, w, b, *_r, **_k) -> float:
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]


def _flops_attention(q, k, v, out, sinks, lk, *_r, **_k) -> float:
    lq, hq, d = q.shape if q.dim() == 3 else (q.shape[0], 1, q.shape[1])
    return 4.0 * lq * lk * hq * d


def _flops_gate_up(z, src, tile_group, tile_rows, w_gate, w_up, hidden, *_r, **k) -> float:
    return 4.0 * hidden.shape[0] * k["D"] * hidden.shape[1]


def _flops_down(hidden, w_down, routed, *_r, **k) -> float:
    return 2.0 * hidden.shape[0] * k["F"] * routed.shape[1]


def _flops_expert_tile(z, src, tile_group, tile_rows, w_gate, w_up, w_down, routed, *_r,
                       **k) -> float:
    """gate + up (recomputed for each of the N_BLOCKS output column blocks) and down."""
    return 2.0 * routed.shape[0] * k["D"] * k["F"] * (2 * k["N_BLOCKS"] + 1)


def _flops_route(z, gate, *_r, **_k) -> float:
    return 2.0 * z.shape[0] * gate.shape[0] * gate.shape[1]


def _flops_linear(a, idx, inv, nw, b, bias, add, c, m, n, k, *_r, **_kw) -> float:
    return 2.0 * m * n * k


def _bytes_linear(a, idx, inv, nw, b, bias, add, c, m, n, k, *_r, **kw) -> float:
    """The rows it reads and writes (a gathered launch touches its `m` rows of a and c, not
    all of them), the weight, and the per-row index / norm scale."""
    per_row = k * a.element_size() + c.shape[1] * c.element_size()
    per_row += (8 if kw["GATHER"] else 0) + (4 if kw["NORM"] else 0) + (
        4 * c.shape[1] if kw["ADD"] else 0) + (4 * inv.shape[1] if kw["SCALE_DIV"] else 0)
    return m * per_row + _nbytes(b) + (k * 4 if kw["NORM"] else 0) + (
        n * 4 if kw["HAS_BIAS"] else 0)


def _flops_elementwise(*args, **_k) -> float:
    return float(max((t.numel() for t in _tensors(args)), default=0))


#: FLOPs of each Triton kernel from its launch arguments (bytes: its tensor arguments)
KERNEL_COST = {
    "matmul_kernel": _flops_matmul, "rms_matmul_kernel": _flops_rms_matmul,
    "sink_attention_kernel": _flops_attention,
    "gate_up_kernel": _flops_gate_up, "down_kernel": _flops_down, "route_kernel": _flops_route,
    "linear_kernel": _flops_linear, "expert_tile_kernel": _flops_expert_tile,
}  # fmt: skip
#: bytes of the kernels that touch only part of their tensor arguments (others: all of them)
KERNEL_BYTES = {"linear_kernel": _bytes_linear}


class FakeKernels:
    """Stands in for a `*_kernels` module: `kern[grid](*args)` records one launch."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def __getattr__(self, name: str):
        if name == "LOG2E":
            return SimpleNamespace(value=math.log2(math.e))
        ledger = self.ledger

        def launch(*args, **kwargs):
            cost = KERNEL_COST.get(name, _flops_elementwise)
            with torch.utils._python_dispatch._disable_current_modes():
                flops = cost(*args, **kwargs)
                nbytes = (KERNEL_BYTES[name](*args, **kwargs) if name in KERNEL_BYTES else
                          sum(_nbytes(t) for t in {id(t): t for t in _tensors(args)}.values()))
            ledger.launch(name, flops, nbytes, name in GEMM_KERNELS)

        return _Launcher(launch)


class _Launcher:
    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _region(ledger: Ledger, name: str, fn):
    def wrapped(*args, **kwargs):
        ledger.region.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            ledger.region.pop()

    return wrapped


def _moe_forward(ledger: Ledger):
    """`MultiHeadMoE.forward` with the exchanges replaced: the rank computes its head shard
    for the tokens the dispatch delivers to it."""

    def forward(self, x, token_counts=None, dispatch=None):
        cfg, t = self.config, x.shape[0]
        owned = t if dispatch is None else dispatch.layout.owned_tokens
        moved = 0 if dispatch is None or dispatch.layout.world_size == 1 else (
            owned * self.local_heads * cfg.head_dim * x.element_size())
        ledger.comm["moe_scatter"] += moved
        z = torch.empty((owned, self.real_heads, cfg.head_dim), dtype=x.dtype, device=x.device)
        if self.real_heads and owned:
            self.compute_heads(z)
        ledger.comm["moe_gather"] += moved
        return torch.empty_like(x)

    return forward


def _ulysses(ledger: Ledger, sp: int):
    def to_heads(qkv, group, counts, counters=None):
        full = sum(counts)
        ledger.comm["ulysses_in"] += _nbytes(qkv)
        return qkv.new_empty((full, qkv.shape[1], qkv.shape[2] // sp, qkv.shape[3]))

    def to_seq(o, group, counts, counters=None):
        ledger.comm["ulysses_out"] += _nbytes(o)
        return o.new_empty((counts[0], o.shape[1] * sp, o.shape[2]))

    return to_heads, to_seq


@contextlib.contextmanager
def cuda_dispatch(ledger: Ledger, sp: int):
    """The CUDA branches of the layers, recorded in `ledger` (patches undone on exit)."""
    fake = FakeKernels(ledger)
    to_heads, to_seq = _ulysses(ledger, sp)
    patches = [
        (triton_runtime, "use_triton", lambda t: True),
        (triton_dense, "kernels", lambda m: fake), (triton_attention, "kernels", lambda m: fake),
        (triton_moe, "kernels", lambda m: fake), (triton_mhc, "kernels", lambda m: fake),
        (triton_mhc, "check_tensors", lambda *a, **t: None),
        (triton_dense, "check_tensors", lambda *a, **t: None),
        (triton_attention, "check_tensors", lambda *a, **t: None),
        (triton_moe, "check_tensors", lambda *a, **t: None),
        (triton_attention, "descriptor", lambda t, *a, **k: t),
        (triton_moe, "descriptor", lambda t, *a, **k: t),
        (magi2_model, "ulysses_qkv_to_heads", to_heads),
        (magi2_model, "ulysses_heads_to_seq", to_seq),
        (moe_layer.MultiHeadMoE, "forward", _moe_forward(ledger)),
    ]
    for name in ("mhc_mix", "mhc_input", "mhc_update"):
        patches.append((magi2_model, name, _region(ledger, "mhc", getattr(magi2_model, name))))
    patches.append((magi2_model, "segment_attention",
                    _region(ledger, "attention", magi2_model.segment_attention)))
    patches.append((moe_layer.MultiHeadMoE, "compute_heads",
                    _region(ledger, "experts", moe_layer.MultiHeadMoE.compute_heads)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _branches(cfg, grid, audio: int) -> list[BranchInput]:
    video = torch.zeros(*grid, cfg.video_in_channels)
    return [BranchInput(video, torch.zeros(audio, cfg.audio_in_channels),
                        torch.zeros(TEXT_TOKENS, cfg.text_in_channels), 0.5, 0.5)
            for _ in range(2)]  # fmt: skip


def _layer_multiplicity(cfg) -> dict[bool, tuple[int, int]]:
    """multimodal? -> (first layer id of that kind, layers of that kind)."""
    kinds: dict[bool, list[int]] = defaultdict(list)
    for i in range(cfg.num_layers):
        kinds[i in cfg.multimodal_layers].append(i)
    return {k: (ids[0], len(ids)) for k, ids in kinds.items()}


def measure(resolution: str, sp: int, ep: int, model: str = "magi2-preview") -> dict:
    """The proxy figures of one forward on rank 0 of SP `sp` / EP `ep` at `resolution`."""
    cfg = get_config(model)
    height, width = RESOLUTIONS[resolution]
    shape = RequestShape.from_media(height=height, width=width, num_frames=125, fps=12.5,
                                    text_tokens=TEXT_TOKENS, uncond_text_tokens=TEXT_TOKENS)
    parallel = ParallelConfig(ulysses_degree=sp, enable_expert_parallel=ep > 1,
                              expert_parallel_size=ep if ep > 1 else None)
    ctx = ParallelContext(topology=plan_topology(sp, parallel), rank=0,
                          _groups={a: None for a in AXES})
    packed = pack_branches(_branches(cfg, shape.video_latent, shape.audio_tokens), cfg)
    ledger = Ledger()
    kinds = _layer_multiplicity(cfg)
    with torch.device("meta"):
        layers = {k: magi2_model.Magi2Layer(cfg, first, torch.bfloat16, ctx, None)
                  for k, (first, _) in kinds.items()}  # fmt: skip
        net = _adapters(cfg, ctx)
    plan = net.plan(packed)
    with cuda_dispatch(ledger, sp), CountOps(ledger):
        state = net._embed(packed, plan)
        for k, layer in layers.items():
            before = _snapshot(ledger)
            state = layer(state, plan)
            _repeat(ledger, before, kinds[k][1] - 1)
        net._post(state, plan)
    acts = estimate_memory(cfg, shape, parallel, torch.bfloat16).activations
    return _summary(ledger, plan, acts)


def _adapters(cfg, ctx) -> magi2_model.Magi2Transformer:
    """A transformer without layers (its plan, embedding and post-adapter)."""
    net = magi2_model.Magi2Transformer.__new__(magi2_model.Magi2Transformer)
    torch.nn.Module.__init__(net)
    net.config, net.context, net.dtype = cfg, ctx, torch.bfloat16
    net.attention = "triton"  # the path counted: the Triton sink kernel (--attention's default)
    net.pre_adapter = magi2_model.PreAdapter(cfg)
    net.post_adapter = magi2_model.PostAdapter(cfg)
    with torch.device("cpu"):  # the RoPE table is computed on the host
        net.pre_adapter.rope = magi2_model.Rope(cfg.rope_bands)
    return net


def _snapshot(ledger: Ledger):
    return {k: list(v) for k, v in ledger.rows.items()}, Counter(ledger.comm)


def _repeat(ledger: Ledger, before, times: int) -> None:
    """Add `times` more copies of what was recorded since `before` (a `_snapshot`)."""
    rows, comm = before
    for key, v in list(ledger.rows.items()):
        b = rows.get(key, [0, 0.0, 0.0, 0.0])
        for j in range(4):
            v[j] += times * (v[j] - b[j])
    for key, v in list(ledger.comm.items()):
        ledger.comm[key] += times * (v - comm.get(key, 0))


def _summary(ledger: Ledger, plan, plan_acts: int) -> dict:
    flops = Counter()
    launches = nbytes = seconds = elementwise = 0.0
    for (region, _name, gemm), (n, f, b, s) in ledger.rows.items():
        flops[region] += f
        launches += n
        nbytes += b
        seconds += s
        if not gemm:
            elementwise += s
    return {"local_tokens": plan.local_tokens, "launches": int(launches), "flops": flops,
            "bytes": nbytes, "roofline_s": seconds, "elementwise_s": elementwise,
            "peak_bytes": ledger.peak, "plan_activation_bytes": plan_acts,
            "comm_bytes": sum(ledger.comm.values()), "rows": ledger.rows}  # fmt: skip


def top_launches(rows, n: int = 12) -> list[list]:
    """The `n` (region, name) rows with the largest roofline time."""
    items = sorted(rows.items(), key=lambda kv: -kv[1][3])[:n]
    return [[r, name, v[0], f"{v[3] * 1e3:.1f}"] for (r, name, _g), v in items]


def table(results: list[tuple[str, str, dict]]) -> str:
    headers = ["res", "layout", "local tokens", "launches", "TFLOP attn", "linears", "experts",
               "mhc", "other", "HBM GB", "roofline s", "elementwise s", "peak act GiB",
               "plan act GiB", "comm GB"]  # fmt: skip
    body = []
    for res, label, r in results:
        f = r["flops"]
        body.append([res, label, r["local_tokens"], r["launches"],
                     *(f"{f[k] / 1e12:.1f}" for k in ("attention", "linears", "experts", "mhc",
                                                        "other")),
                     f"{r['bytes'] / 1e9:.0f}", f"{r['roofline_s']:.3f}",
                     f"{r['elementwise_s']:.3f}", f"{r['peak_bytes'] / 2**30:.2f}",
                     f"{r['plan_activation_bytes'] / 2**30:.2f}",
                     f"{r['comm_bytes'] / 1e9:.2f}"])  # fmt: skip
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="272p SP8/EP4 only")
    parser.add_argument("--model", default="magi2-preview")
    parser.add_argument("--top", type=int, default=0, help="print the N costliest launches")
    args = parser.parse_args(argv)
    cases = [("272p", LAYOUTS[2])] if args.quick else [
        (res, lay) for res in ("272p", "540p") for lay in LAYOUTS]
    results = []
    for res, (label, sp, ep) in cases:
        r = measure(res, sp, ep, args.model)
        results.append((res, label, r))
        if args.top:
            print(f"{res} {label}:")
            print(markdown_table(["region", "launch", "count", "ms"], top_launches(r["rows"], args.top)))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
