"""Error of FP8 routed experts against bf16 ones: the same request, both formats (issue 28).

    .venv/bin/python benchmarks/bench_fp8_error.py [--quick] [--steps 8] [--reps 3]

One process builds the same synthetic MAGI-2-shaped transformer twice from one bf16
checkpoint: once with the release's bf16 experts, once with FP8 experts quantized on load
(`--expert-format fp8`: `headmoe.moe.fp8`), with the tiny release's text encoder and
decoders. It runs the same request (prompt, seed, noise) through both and reports:

- per MoE layer, on the first forward: the relative L2 error of the MoE output given the
  same input (the bf16 run's input fed to the FP8 layer: that layer's own error), the same
  in the FP8 run (errors of the layers before included), the share of (token, head) rows
  whose top-k expert set differs in the FP8 run, and the share whose top-k set in the
  *next* MoE layer changes when only this layer's experts are FP8;
- the final latents' relative L2 and cosine (video, audio), the decoded uint8 video's PSNR
  and the int16 audio's SNR;
- one denoising step's CPU time in each format (the two formats alternating, `--reps`
  times after a warm-up), min / median, with the load average.

The synthetic checkpoint (`write_random_checkpoint`): Gaussian weights scaled by
1/sqrt(fan-in), the init every random headmoe checkpoint uses. It is not the release's
weight distribution: no per-tensor statistics of the released weights are in this
repository (golden/magi2/preview_tensors.tsv lists names, shapes and dtypes only), so the
figures hold for this init; trained weights with outlier channels may differ.

Full mode: MAGI-2's MoE head geometry (head width 256, 256 experts, top-6, expert width
1280) on one MoE head and 8 layers (4 MoE), bf16, the tiny recipe's 96 x 64, 13 frames.
`--quick` (the test's): a few-expert model, 2 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/bench_fp8_error.py` from a clone

import torch  # noqa: E402

from benchmarks.common import load_average, markdown_table, min_median  # noqa: E402
from headmoe.distributed.context import ParallelContext  # noqa: E402
from headmoe.models.magi2.config import Magi2Config  # noqa: E402
from headmoe.models.magi2.loading import write_random_checkpoint  # noqa: E402
from headmoe.moe import MultiHeadMoE  # noqa: E402
from headmoe.moe.routing import route  # noqa: E402
from headmoe.pipeline.deployment import Deployment  # noqa: E402
from headmoe.pipeline.job import (  # noqa: E402
    GenerateJob,
    build_components,
    decode,
    denoise,
    draw_noise,
    encode_prompts,
)
from headmoe.pipeline.request import GenerateRequest  # noqa: E402
from headmoe.release import folder as release  # noqa: E402
from headmoe.release.components import magi2_components  # noqa: E402

PROMPT = "a red fox running through snow at dusk"
FORMATS = ("bf16", "fp8")


def synthetic_config(quick: bool) -> Magi2Config:
    """The transformer: MAGI-2's MoE head geometry (full) or a few-expert one (quick), with
    the tiny release's channels (text 64, video 48, audio 64) so its encoder and decoders
    run with it."""
    common = dict(video_in_channels=48, audio_in_channels=64, text_in_channels=64, moe_top_k=6)
    if quick:
        return Magi2Config(name="fp8-error-quick", num_layers=4, multimodal_layers=(0, 3),
                           hidden_size=64, head_dim=16, num_query_groups=4, moe_num_heads=2,
                           moe_num_experts=16, moe_expert_intermediate_size=64,
                           shared_expert_intermediate_size=64,
                           modality_shared_expert_intermediate_size=64, **common)
    return Magi2Config(name="fp8-error-magi2-moe", num_layers=8,
                       multimodal_layers=(0, 1, 6, 7), hidden_size=256, head_dim=128,
                       num_query_groups=2, moe_num_heads=1, moe_num_experts=256,
                       moe_expert_intermediate_size=1280,
                       shared_expert_intermediate_size=1280,
                       modality_shared_expert_intermediate_size=1280, **common)


def build(cfg: Magi2Config, checkpoint: Path, cache: Path, req: GenerateRequest
          ) -> dict[str, tuple[GenerateJob, Any]]:
    """format -> (job, components): the tiny release's encoder and decoders around the
    synthetic transformer loaded from ``checkpoint`` in that expert format."""
    tiny = release.find_release(release.tiny_release(cache))
    rel = dataclasses.replace(tiny, model_config=cfg, transformer=str(checkpoint))
    out = {}
    for fmt in FORMATS:
        dep = Deployment(model_config=cfg, checkpoint=str(checkpoint), release=rel,
                         expert_format=fmt)
        job = GenerateJob(deployment=dep, request=req, output=None, progress=False,
                          components=magi2_components)
        out[fmt] = (job, build_components(ParallelContext.single(), job))
    return out


def moe_layers(parts: Any) -> list[MultiHeadMoE]:
    """The MoE modules of a components' transformer, in layer order."""
    return [m for m in parts.denoiser.model.modules() if isinstance(m, MultiHeadMoE)]


def top_k(moe: MultiHeadMoE, x: torch.Tensor) -> torch.Tensor:
    """The routed experts `[N, h, k]` (ascending ids) of MoE input x `[N, hidden]`."""
    c = moe.config
    rows = moe.real_heads * c.num_experts
    z = x.reshape(x.shape[0], c.num_heads, c.head_dim)
    return route(z, moe.gate[:rows], moe.router.expert_bias[:rows], c.top_k, c.route_scale)[0]


def changed(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (token, head) rows whose expert sets differ (`[N, h, k]`, sorted ids)."""
    return (a != b).any(dim=-1).float().mean().item()


def rel_l2(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return ((x - ref).norm() / ref.norm()).item()


def cosine(ref: torch.Tensor, x: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(ref.double().flatten(), x.double().flatten(),
                                                 dim=0).item()


class Recorder:
    """Forward hooks on every MoE module: the first call's input and output; ``replace``
    (layer index -> function of the input) substitutes that layer's output."""

    def __init__(self, moes: list[MultiHeadMoE],
                 replace: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None):
        self.io: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(moes)
        self.handles = [m.register_forward_hook(self._hook(i, (replace or {}).get(i)))
                        for i, m in enumerate(moes)]

    def _hook(self, i: int, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> Callable:
        def hook(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
            y = out if fn is None else fn(args[0])
            if self.io[i] is None:
                self.io[i] = (args[0].clone(), y.clone())
            return y
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run(ctx: ParallelContext, job: GenerateJob, parts: Any) -> dict[str, Any]:
    """The request through ``parts``: the first forward's branches and MoE inputs/outputs,
    the final latents, the decoded frames and audio."""
    req = job.request
    seen: list[Any] = []
    inner = parts.denoiser
    rec = Recorder(moe_layers(parts))
    parts.denoiser = lambda branches: (seen.append(branches) if not seen else None) or (
        inner(branches))
    try:
        noise = draw_noise(ctx, req, parts)
        texts, _ = encode_prompts(parts.text_encoder, (req.prompt, req.negative_prompt),
                                  ctx.device)
        xv, xa, _ = denoise(ctx, job, parts, noise, texts)
    finally:
        rec.close()
        parts.denoiser = inner
    frames, audio = decode(parts, req, xv, xa, noise.num_samples)
    return {"branches": seen[0], "io": rec.io, "video": xv, "audio": xa, "frames": frames,
            "wave": audio}


def layer_rows(runs: dict[str, dict], parts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per MoE layer: own error, error in the FP8 run, top-k change in the FP8 run, and
    the next layer's top-k change with only this layer in FP8 (see the module doc)."""
    bf, fp = moe_layers(parts["bf16"]), moe_layers(parts["fp8"])
    ref, got = runs["bf16"]["io"], runs["fp8"]["io"]
    rows = []
    for i, (x, y) in enumerate(ref):
        own = fp[i](x)
        row = {"layer": i, "own_rel_l2": rel_l2(y, own), "run_rel_l2": rel_l2(y, got[i][1]),
               "topk_changed_in_fp8_run": changed(top_k(bf[i], x), top_k(bf[i], got[i][0]))}
        if i + 1 < len(ref):
            rec = Recorder(bf, {i: fp[i]})
            try:
                parts["bf16"].denoiser(runs["bf16"]["branches"])
            finally:
                rec.close()
            nxt = rec.io[i + 1]
            assert nxt is not None
            row["next_topk_changed"] = changed(top_k(bf[i + 1], ref[i + 1][0]),
                                               top_k(bf[i + 1], nxt[0]))
        rows.append(row)
    return rows


def media_figures(runs: dict[str, dict]) -> dict[str, float]:
    """Final latents' relative L2 / cosine, the frames' PSNR (dB, 8-bit peak), the audio's
    SNR (dB, int16 as decoded)."""
    a, b = runs["bf16"], runs["fp8"]
    mse = (a["frames"].double() - b["frames"].double()).pow(2).mean().item()
    noise = (a["wave"].double() - b["wave"].double()).pow(2).sum().item()
    return {
        "video_latent_rel_l2": rel_l2(a["video"], b["video"]),
        "video_latent_cosine": cosine(a["video"], b["video"]),
        "audio_latent_rel_l2": rel_l2(a["audio"], b["audio"]),
        "audio_latent_cosine": cosine(a["audio"], b["audio"]),
        "video_psnr_db": math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse),
        "audio_snr_db": math.inf if noise == 0 else
        10 * math.log10(a["wave"].double().pow(2).sum().item() / noise),
    }


def step_times(runs: dict[str, dict], parts: dict[str, Any], reps: int) -> dict[str, list[float]]:
    """One denoising step (both CFG branches in one forward) per format, alternating,
    after one warm-up each: seconds."""
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    for i in range(reps + 1):
        for fmt in FORMATS:
            t0 = time.perf_counter()
            parts[fmt].denoiser(runs["bf16"]["branches"])
            if i:
                times[fmt].append(time.perf_counter() - t0)
    return times


def measure(quick: bool, steps: int, reps: int, seed: int, threads: int) -> dict[str, Any]:
    """Every figure of the module doc for one request."""
    torch.set_num_threads(threads)
    cfg = synthetic_config(quick)
    req = GenerateRequest(prompt=PROMPT, height=32 if quick else 64, width=48 if quick else 96,
                          num_frames=5 if quick else 13, num_inference_steps=steps, seed=seed,
                          dtype="bf16")
    with tempfile.TemporaryDirectory(prefix="fp8-error-") as tmp:
        ckpt = Path(tmp) / "preview" / "model.safetensors.index.json"
        ckpt.parent.mkdir()
        write_random_checkpoint(cfg, ckpt, seed=seed)
        built = build(cfg, ckpt, Path(tmp) / "cache", req)
        parts = {f: p for f, (_, p) in built.items()}
        ctx = ParallelContext.single()
        runs = {f: run(ctx, job, p) for f, (job, p) in built.items()}
        with torch.no_grad():
            layers = layer_rows(runs, parts)
        times = step_times(runs, parts, reps)
    return {"config": cfg.name, "request": {"height": req.height, "width": req.width,
            "num_frames": req.num_frames, "steps": steps, "seed": seed, "dtype": req.dtype},
            "tokens_per_forward": int(runs["bf16"]["io"][0][0].shape[0]),
            "layers": layers, "media": media_figures(runs), "step_s": times,
            "threads": threads, "load": load_average()}


def report(r: dict[str, Any]) -> str:
    """The figures as Markdown."""
    rows = [[x["layer"], f"{x['own_rel_l2']:.4f}", f"{x['run_rel_l2']:.4f}",
             f"{100 * x['topk_changed_in_fp8_run']:.2f}%",
             f"{100 * x['next_topk_changed']:.2f}%" if "next_topk_changed" in x else "-"]
            for x in r["layers"]]
    m = r["media"]
    s = r["step_s"]
    lines = [f"{r['config']}, {r['request']}, {r['tokens_per_forward']} rows per forward",
             markdown_table(["MoE layer", "own rel. L2", "rel. L2 in the FP8 run",
                             "top-k set changed (FP8 run)", "next layer's top-k changed "
                             "(this layer FP8 only)"], rows), "",
             markdown_table(["figure", "value"], [[k, f"{v:.6g}"] for k, v in m.items()]), "",
             f"one step (both branches), {r['threads']} thread(s), min / median s over "
             f"{len(s['bf16'])} alternating reps: bf16 {min_median(s['bf16'])}, "
             f"fp8 {min_median(s['fp8'])}; {r['load']}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="FP8 vs bf16 routed experts: error and CPU "
                                "step time on one request (see the module doc)")
    p.add_argument("--quick", action="store_true", help="a few-expert model, 2 steps")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 8, "
                   "quick 2)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per format (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    steps = args.steps or (2 if args.quick else 8)
    r = measure(args.quick, steps, args.reps, args.seed, args.threads)
    print(report(r))
    if args.json is not None:
        args.json.write_text(json.dumps(r, indent=2, default=str))


if __name__ == "__main__":
    main()
