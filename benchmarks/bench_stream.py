"""Layer streaming on CPU (issue 20): peak RSS and step time, resident vs `--offload-layers`.

    .venv/bin/python benchmarks/bench_stream.py [--reps 3] [--rounds 2] [--slots 2]

A synthetic MAGI-2-shaped model of about 2.6 GB (fp32, 12 layers, 10 of them MoE with
12 heads x 32 experts) is written once to a temporary folder; then each mode runs in its own
fresh process (alternating resident, streamed, resident, ... for `--rounds` rounds), builds
the model on one CPU thread, runs one warm-up forward and `--reps` timed forwards (one
forward = one denoising step with both CFG branches packed) of a 312-token request, and
reports its peak RSS (VmHWM of loading and of the forwards; not `ru_maxrss`, which a
child inherits from its parent's size at exec) above the RSS it had after its imports, and
the peak during the forwards (VmHWM reset after loading) above its RSS after loading.

The streamed run's bound: weights outside the layers + `slots` slots (the planner's exact
numbers, `headmoe.planner.memory.stream_estimate`) + the activations, measured as the
resident run's forward peak above its RSS after loading (the planner's activation estimate
is printed beside it). The page cache holding the file is shared memory of the node, not the process's
RSS (the streamer drops each chunk's mapping after copying it). Step-time ratio: median
streamed / median resident. Not part of the test suite; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
#: model: a few GB in fp32 (fp32 experts are used in place; bf16 ones would be widened
#: chunk by chunk, which adds a transient unrelated to streaming)
OVERRIDES = dict(
    name="bench-stream", num_layers=12, multimodal_layers=(0, 11), hidden_size=768,
    head_dim=64, num_query_groups=12, moe_num_heads=12, moe_num_experts=32, moe_top_k=2,
    moe_expert_intermediate_size=768, shared_expert_intermediate_size=768,
    modality_shared_expert_intermediate_size=768, params_dtype="float32",
)
#: request: video latent grid, audio latents, text tokens (cond, uncond); 312 tokens
VIDEO, AUDIO, TEXTS = (2, 6, 8), 40, (32, 8)
MIB = 1 << 20


def config():
    """The benchmark's `Magi2Config`."""
    from dataclasses import replace

    from headmoe.models.magi2 import get_config

    return replace(get_config("tiny"), **OVERRIDES)


def _status_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS: now, VmHWM: peak since the last reset)."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    """Restart VmHWM from the current RSS (Linux: "5" to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _branches(cfg, video, audio, texts):
    """CFG branches (one per text length) of random latents."""
    import torch

    from headmoe.models.magi2 import BranchInput

    g = torch.Generator().manual_seed(0)
    return [BranchInput(torch.randn(*video, cfg.video_in_channels, generator=g),
                        torch.randn(audio, cfg.audio_in_channels, generator=g),
                        torch.randn(n, cfg.text_in_channels, generator=g), 0.7, 0.7)
            for n in texts]


def _warm_up(params_dtype: str) -> None:
    """Run a tiny model resident and streamed once, so that the code both modes touch
    (torch kernels, safetensors, the streamer's thread) is loaded before the baseline."""
    import gc
    from dataclasses import replace

    import torch

    from headmoe.distributed import ParallelContext
    from headmoe.models.magi2 import (
        Magi2Transformer,
        get_config,
        load_checkpoint,
        write_random_checkpoint,
    )
    from headmoe.models.magi2.loading import stream_layers

    cfg = replace(get_config("tiny"), params_dtype=params_dtype)
    with tempfile.TemporaryDirectory(prefix="headmoe-bench-warm-") as tmp:
        path = str(Path(tmp) / "tiny.safetensors")
        write_random_checkpoint(cfg, path)
        req = _branches(cfg, (2, 2, 3), 4, (3, 2))
        model = Magi2Transformer(cfg, ParallelContext.single())
        load_checkpoint(model, path)
        model(req)
        streamed, streamer = stream_layers(cfg, ParallelContext.single(), torch.float32, path)
        streamed(req)
        streamer.close()
    del model, streamed, streamer
    gc.collect()


def child(mode: str, ckpt: str, reps: int, slots: int) -> dict:
    """One mode in this (fresh) process: build, warm up, time `reps` forwards."""
    import torch

    from headmoe.distributed import ParallelContext
    from headmoe.models.magi2 import Magi2Transformer, load_checkpoint
    from headmoe.models.magi2.loading import stream_layers

    torch.set_num_threads(1)
    cfg = config()
    branches = _branches(cfg, VIDEO, AUDIO, TEXTS)
    _warm_up(cfg.params_dtype)
    base = _status_kib("VmRSS")
    ctx = ParallelContext.single()
    t0 = time.perf_counter()
    if mode == "resident":
        model = Magi2Transformer(cfg, ctx, dtype=torch.float32)
        load_checkpoint(model, ckpt)
    else:
        model, _ = stream_layers(cfg, ctx, torch.float32, ckpt, slots=slots)
    load_s = time.perf_counter() - t0
    loaded, load_peak = _status_kib("VmRSS"), _status_kib("VmHWM")
    _reset_peak()
    out = model(branches)  # warm-up (and the streamed run's first fills)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = model(branches)
        times.append(time.perf_counter() - t0)
    digest = float(sum(o.video.double().sum() + o.audio.double().sum() for o in out))
    forward_peak = _status_kib("VmHWM")
    return {"mode": mode, "load_s": load_s, "step_s": times, "base_kib": base,
            "loaded_kib": loaded, "forward_peak_kib": forward_peak,
            "peak_kib": max(load_peak, forward_peak), "digest": digest}


def predicted(slots: int) -> dict:
    """The planner's terms for the streamed run (bytes)."""
    import torch

    from headmoe.config import ParallelConfig
    from headmoe.planner.memory import StreamSettings, estimate_memory, stream_estimate
    from headmoe.planner.predict import weight_bytes
    from headmoe.planner.request import RequestShape

    cfg = config()
    shape = RequestShape(VIDEO, AUDIO, TEXTS)
    s = stream_estimate(cfg, 1, 0, torch.float32, StreamSettings(0, slots))
    est = estimate_memory(cfg, shape, ParallelConfig(), torch.float32)
    return {"non_layer": s.non_layer_bytes, "in_flight": s.in_flight_bytes,
            "activations": est.activations + est.workspace,
            "resident_weights": weight_bytes(cfg, 1, 0, torch.float32)[1],
            "bytes_per_step": s.bytes_per_step}


def _run_child(mode: str, ckpt: str, reps: int, slots: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", ckpt, "--reps", str(reps),
           "--slots", str(slots)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--child", choices=("resident", "streamed"))
    p.add_argument("--ckpt")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.ckpt, args.reps, args.slots)))
        return
    sys.path[:0] = [str(REPO / "src"), str(REPO)]
    from headmoe.models.magi2 import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="headmoe-bench-stream-") as tmp:
        ckpt = str(Path(tmp) / "model.safetensors.index.json")
        t0 = time.perf_counter()
        write_random_checkpoint(config(), ckpt, seed=1)
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        print(f"checkpoint {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s")
        runs = [_run_child(m, ckpt, args.reps, args.slots)
                for _ in range(args.rounds) for m in ("resident", "streamed")]
    report(runs, predicted(args.slots), size, args)


def report(runs: list[dict], pred: dict, size: int, args: argparse.Namespace) -> None:
    """Print the table and the bound check (bytes from KiB; worst run of each mode)."""
    by = {m: [r for r in runs if r["mode"] == m] for m in ("resident", "streamed")}
    assert len({r["digest"] for r in runs}) == 1, "streamed and resident outputs differ"
    step = {m: statistics.median(t for r in rs for t in r["step_s"]) for m, rs in by.items()}
    peak = {m: max((r["peak_kib"] - r["base_kib"]) * 1024 for r in rs) for m, rs in by.items()}
    # activations: the resident run's forward peak above its loaded RSS (same forward)
    acts = max((r["forward_peak_kib"] - r["loaded_kib"]) * 1024 for r in by["resident"])
    bound = pred["non_layer"] + pred["in_flight"] + acts
    print(f"\nmodel {size / 1e9:.2f} GB on disk, {args.slots} slots, {args.reps} timed steps "
          f"x {args.rounds} rounds per mode, 1 thread; outputs identical in every run\n")
    from benchmarks.common import load_average, min_median

    print(load_average())
    print("| mode | peak RSS above baseline, MiB | step time, s (min / median) | load, s |")
    print("|---|---|---|---|")
    for m in ("resident", "streamed"):
        load = statistics.median(r["load_s"] for r in by[m])
        steps = min_median([t for r in by[m] for t in r["step_s"]])
        print(f"| {m} | {peak[m] / MIB:,.0f} | {steps} | {load:.2f} |")
    print(f"\nstreamed bound: non-layer weights {pred['non_layer'] / MIB:,.1f} + {args.slots} "
          f"layers in flight {pred['in_flight'] / MIB:,.1f} (planner, exact) + activations "
          f"{acts / MIB:,.1f} (measured: resident forward peak above its loaded RSS; the "
          f"planner's estimate is {pred['activations'] / MIB:,.1f}) = {bound / MIB:,.1f} MiB")
    print(f"streamed peak / bound = {peak['streamed'] / bound:.3f}")
    print(f"resident weights {pred['resident_weights'] / MIB:,.1f} MiB; resident peak / "
          f"streamed peak = {peak['resident'] / peak['streamed']:.2f}")
    print(f"step time streamed / resident = {step['streamed'] / step['resident']:.2f} "
          f"({pred['bytes_per_step'] / 1e9:.2f} GB copied per step)")


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------------- GPU section
#: the key of `gpu_section` among benchmarks/gpu_check.py's sections
SECTION = "f"
#: synthetic layers per forward and linears per layer in the GPU section
GPU_LAYERS, GPU_LINEARS = 6, 8


class SynthLayer(nn.Module):
    """`GPU_LINEARS` square bf16 linears applied in turn (RMS-normalised in between), with
    the bytes of one real layer: the generic streamer streams any list of layer modules."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(width, width, dtype=dtype, device=device),
                               requires_grad=False) for _ in range(GPU_LINEARS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[tokens, width]` -> `[tokens, width]`, same dtype."""
        for w in self.weights:
            x = F.linear(x, w)
            x = x * x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt().to(x.dtype)
        return x


def _synth_width(ctx) -> int:
    """Square width whose `GPU_LINEARS` bf16 matrices hold one MAGI-2 Preview MoE layer of
    an EP4 rank (the per-rank shapes of the other sections); 64 in a dry run."""
    import torch

    from headmoe.models.magi2 import get_config
    from headmoe.planner.predict import layer_bytes

    if ctx.dry:
        return 64
    preview = get_config("magi2-preview")
    moe = layer_bytes(preview, 4, 0, torch.bfloat16)[preview.moe_layer_ids[0]][0]
    return int((moe / GPU_LINEARS / 2) ** 0.5) // 128 * 128


def gpu_section(ctx) -> None:
    """gpu_check section f: one layer's bytes written once to a safetensors file; H2D GB/s
    (pinned -> device), the host stage (mapped file -> pinned) GB/s; then `GPU_LAYERS`
    synthetic layers run resident and streamed (2 slots) at two token counts: step times,
    their ratio, the fraction of the copy time hidden behind compute, and bit equality."""
    import torch
    from safetensors.torch import save_file

    from headmoe.models.streaming import LayerStreamer, MappedCheckpoint, TensorRead

    width, dev, dt = _synth_width(ctx), torch.device(ctx.device), ctx.dtype
    nbytes = GPU_LINEARS * width * width * dt.itemsize
    shape = f"{GPU_LINEARS} x [{width}, {width}] {str(dt)[6:]} = {nbytes / 2**30:.2f} GiB/layer"
    with tempfile.TemporaryDirectory(prefix="headmoe-gpu-stream-") as tmp:
        path = str(Path(tmp) / "layer.safetensors")
        gen = torch.Generator().manual_seed(0)
        save_file({f"w{j}": (torch.randn(width, width, generator=gen) / width**0.5).to(dt)
                   for j in range(GPU_LINEARS)}, path)
        source = MappedCheckpoint({f"w{j}": path for j in range(GPU_LINEARS)})
        reads = [TensorRead(f"weights.{j}", f"w{j}") for j in range(GPU_LINEARS)]
        _gpu_copy_rates(ctx, source, reads, width, shape)
        resident = [SynthLayer(width, dt, dev) for _ in range(GPU_LAYERS)]
        for layer in resident:
            for read, w in zip(reads, layer.weights):
                host = torch.empty(w.shape, dtype=dt)
                source.read_into(read, host)
                w.copy_(host)
        with torch.device("meta"):
            meta = [SynthLayer(width, dt, "meta") for _ in range(GPU_LAYERS)]
        streamer = LayerStreamer(meta, range(GPU_LAYERS), dict.fromkeys(range(GPU_LAYERS),
                                 reads), source, dev, slots=2, timeout_s=120)
        try:
            _gpu_step_times(ctx, resident, meta, streamer, width, shape)
        finally:
            streamer.close()


def _gpu_copy_rates(ctx, source, reads, width, shape) -> None:
    """H2D GB/s of one layer (pinned -> device, CUDA events) and the host stage GB/s."""
    import torch

    n = len(reads)
    pinned = torch.empty(n, width, width, dtype=ctx.dtype, pin_memory=not ctx.dry)
    t0 = time.perf_counter()
    for j, read in enumerate(reads):
        source.read_into(read, pinned[j])
    host_s = time.perf_counter() - t0
    dev = torch.empty_like(pinned, device=ctx.device)
    ms = ctx.time(lambda: dev.copy_(pinned, non_blocking=True))
    nbytes = pinned.numel() * pinned.element_size()
    ctx.report.add(SECTION, "host stage: mapped file -> pinned (one layer)", shape,
                   f"{nbytes / host_s / 1e9:.1f} GB/s")
    ctx.report.add(SECTION, "H2D: pinned -> device (one layer)", shape,
                   "ran (dry)" if ms is None else f"{nbytes / ms / 1e6:.1f} GB/s, {ms:.2f} ms",
                   ">= 25 GB/s (the planner's default)",
                   None if ms is None else nbytes / ms / 1e6 >= 25)


def _gpu_step_times(ctx, resident, meta, streamer, width, shape) -> None:
    """Resident vs streamed forward of the layers at two token counts; copy alone."""
    import torch

    def run(layers, x):
        for layer in layers:
            x = layer(x)
        return x

    def copy_only():
        for i in range(GPU_LAYERS):
            with streamer.use(i):
                pass

    copy_ms = ctx.time(copy_only, reps=3)
    for tokens in ((64, 256) if ctx.dry else (4096, 16384)):
        x = ctx.randn(tokens, width)
        same = torch.equal(run(resident, x), run(meta, x))
        res_ms = ctx.time(lambda x=x: run(resident, x), reps=3)
        str_ms = ctx.time(lambda x=x: run(meta, x), reps=3)
        where = f"{GPU_LAYERS} layers, {tokens:,} tokens; {shape}"
        ctx.report.add(SECTION, "streamed output == resident output", where,
                       str(same), "True", same)
        if res_ms is None:
            ctx.report.add(SECTION, "resident / streamed step", where, "ran (dry)")
            continue
        hidden = (res_ms + copy_ms - str_ms) / copy_ms
        ctx.report.add(SECTION, "step time resident / streamed / copy alone", where,
                       f"{res_ms:.1f} / {str_ms:.1f} / {copy_ms:.1f} ms (streamed "
                       f"{str_ms / res_ms:.2f}x)")
        ctx.report.add(SECTION, "copy time hidden behind compute", where,
                       f"{100 * max(0.0, min(1.0, hidden)):.0f}%")
