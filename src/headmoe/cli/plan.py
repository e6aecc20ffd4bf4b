"""`headmoe plan`: predict every layout of a world for one request and recommend one.

headmoe plan --model magi2-preview --world-size 8 [--height 256 --width 448
    --num-frames 125 --fps 12.5 --text-tokens 250] [--dtype bf16] [--memory-gib 80] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from headmoe.admission import REFINER_FIELDS, Admitted, admit
from headmoe.cli import flags
from headmoe.cli.errors import UserError, run_guarded
from headmoe.config import GIB, MIB, ParallelConfig
from headmoe.deployment import MAX_BUDGET_GIB, build_deployment, stream_of
from headmoe.models.magi2.config import PRESETS
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT
from headmoe.pipeline.deployment import UNCHECKED, Deployment
from headmoe.pipeline.recipe import RESOLUTIONS
from headmoe.pipeline.request import DTYPES
from headmoe.planner.components import component_bytes
from headmoe.planner.memory import DEFAULT_H2D_GBPS, StreamSettings, estimate_memory
from headmoe.planner.plan import LayoutPlan, plan_world
from headmoe.planner.request import RequestShape
from headmoe.release import audio_vae

#: the largest world `plan` enumerates (its layouts grow with the divisors; 4096 ranks take
#: seconds)
MAX_WORLD_SIZE = 4096


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    """Request-shape flags (`generate`'s, from `headmoe.cli.flags`; left out: the model's
    recipe)."""
    flags.add(p, "height", "width", "size", "num_frames", "seconds", "fps",
              height={"help": "pixels (default: the model's recipe, 512 for MAGI-2 Preview)"},
              width={"help": "pixels (default: the model's recipe, 896 for MAGI-2 Preview)"},
              size={"help": "width x height in pixels"},
              num_frames={"help": "output frames (default: the model's recipe, 125 for "
                          "MAGI-2 Preview)"},
              seconds={"help": "clip length; frames = the largest 4k+1 <= seconds x fps"},
              fps={"help": "output frame rate (default: the model's recipe, 12.5)"})
    p.add_argument(
        "--text-tokens",
        type=int,
        default=250,
        help="text tokens of the conditional branch (default 250)",
    )
    p.add_argument(
        "--uncond-text-tokens",
        type=int,
        default=None,
        help="text tokens of the unconditional branch (default: --text-tokens)",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; the handler is `args.run`."""
    p = subparsers.add_parser(
        "plan",
        help="predict per-rank work and traffic of every layout; recommend one",
        description="Enumerate every valid (SP, CFG, DP, EP, MoE exchange) layout of a world "
        "and predict, per rank, the quantities the runtime counters measure.",
    )
    p.add_argument(
        "--model",
        default="magi2-preview",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a release folder (its "
        "preview/config.json, or MAGI-2 Preview's without one; its components size the "
        "encoder and decoder columns)",
    )
    p.add_argument("--world-size", type=int, required=True,
                   help=f"ranks of the world to plan (1 to {MAX_WORLD_SIZE:,})")
    add_request_arguments(p)
    flags.add(p, "dtype", dtype={
        "choices": sorted(DTYPES), "help": "transformer dtype: linears, experts, exchanged "
        "activations (default: the model's recipe on a GPU, bf16 for MAGI-2 Preview)"})
    p.add_argument(
        "--memory-gib",
        type=float,
        default=80.0,
        help="weight budget per rank for the recommendation; 0 = no limit (default 80)",
    )
    p.add_argument(
        "--release",
        default=None,
        help="release folder whose text encoder / decoder configs size the components "
        "(default: the --model preset's)",
    )
    p.add_argument("--video-decoder", choices=("turbo", "wan2.2"), default="turbo",
                   help="video decoder whose bytes are counted (default: turbo)")
    p.add_argument(
        "--image",
        action="store_true",
        help="image-to-video: count the reference image's rows (the most any image adds at "
        "this size) and the Wan2.2 encoder on rank 0",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node: each node's first rank holds the text encoder (default: the "
        "whole world is one node)",
    )
    flags.add(p, "offload", "offload_layers", "resident_layers", "expert_format", offload={
        "help": "encoder and decoders kept on the host between uses (not counted on the "
        "device)"})
    p.add_argument(
        "--h2d-gbps",
        type=float,
        default=DEFAULT_H2D_GBPS,
        help="host-to-device GB/s per GPU the streamed step-time bound assumes (default "
        f"{DEFAULT_H2D_GBPS:g})",
    )
    flags.add(
        p, "resolution", "refiner_height", "refiner_width", "refiner_steps",
        resolution={"choices": sorted(RESOLUTIONS), "metavar": None, "help": "size preset of "
                    "the request (replaces --height/--width; 1080p: the 540p preview and the "
                    "refiner stage at 1920x1088)"},
        refiner_height={"help": "add the refiner stage at this height in pixels (default "
                        "1088, or the --resolution preset's)"},
        refiner_width={"help": "refiner width in pixels (default 1920 when only the height "
                       "is given)"},
        refiner_steps={"help": "refiner steps (default 5)"})
    p.add_argument("--wide", action="store_true",
                   help="every column (attention heads, peers, expert and component bytes)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


def refiner_section(args: argparse.Namespace, request: RequestShape, plans: list[LayoutPlan],
                    stage: Any, cfg: Any) -> tuple[dict[str, Any] | None, str]:
    """The refiner stage of ``plan`` (`headmoe.planner.refiner`): ``stage`` the admitted
    `RefinerStage` (None without the refiner flags: (None, "")), ``cfg`` the deployment's
    refiner configuration; (JSON object, text)."""
    from headmoe.planner.refiner import plan_refiner

    if stage is None:
        return None, ""
    thw = stage.latent_thw(request.video_latent[0])
    work, rplans = plan_refiner(cfg, thw, request.text_tokens[0], [p.parallel for p in plans],
                                DTYPES[args.dtype], stage.steps)
    data = {**stage.to_dict(), "model": cfg.name, "latent": list(thw),
            "video_tokens": work.video_tokens, "text_tokens": work.text_tokens,
            "attention_pairs": work.pairs, "video_keys_per_query": work.video_keys_per_query,
            "dense_fraction": work.dense_fraction, "linear_flop": work.linear_flop,
            "attention_flop": work.attention_flop, "layouts": [r.to_dict() for r in rplans]}
    lines = [f"Refiner stage ({cfg.name}, {stage.width}x{stage.height}, latent "
             f"{thw[0]}x{thw[1]}x{thw[2]}: {work.video_tokens:,} video + {work.text_tokens} "
             f"text tokens; {stage.steps} steps x 2 forwards): per forward "
             f"{work.flop / 1e15:.2f} PFLOP (linears {work.linear_flop / 1e15:.2f}, attention "
             f"{work.attention_flop / 1e15:.2f}: {work.pairs:.4g} pairs, "
             f"{work.video_keys_per_query:,.1f} video keys per video query, "
             f"{100 * work.dense_fraction:.2f}% of dense)", "",
             "| SP | CFG | weights GiB | activations GiB | total GiB | forwards/rank | "
             "PFLOP/rank |", "|---|---|---|---|---|---|---|"]
    for r in rplans:
        m = r.memory
        lines.append(f"| {r.ulysses_degree} | {r.cfg_parallel_size} | {m.weights / GIB:.2f} | "
                     f"{m.activations / GIB:.2f} | {m.total / GIB:.2f} | "
                     f"{r.forwards_per_rank} | {r.flop_per_rank / 1e15:.2f} |")
    return data, "\n".join(lines)


register = add_parser
"""The name `headmoe.cli.main` looks for."""


#: the fields of a request's shape `plan` takes (generate's flags of the same names)
SHAPE_FIELDS = ("height", "width", "size", "num_frames", "seconds", "fps", "resolution")


def request_from_args(args: argparse.Namespace, dep: Deployment) -> Admitted:
    """The request `plan` sizes, admitted once on ``dep`` (`admit`: ranges,
    contradictions, the decoders' geometry, the model's GPU recipe for what is left out, the
    refiner fields; `Refusal` names the field) plus the text encoder's token limit. `plan`
    gives token counts, not text: the request carries `PLACEHOLDER_PROMPT` and the
    returned ``shape`` the counts of ``--text-tokens`` / ``--uncond-text-tokens``.
    ``dep``'s budget is not checked here (`plan` sweeps layouts and recommends one, it
    does not refuse the default layout): `plan_world` checks it per layout. Sets
    ``args.shape`` (height, width, num_frames, fps as resolved) and ``args.dtype`` for the
    command `plan` prints."""
    from headmoe.pipeline.released import MAX_TEXT_TOKENS

    uncond = args.text_tokens if args.uncond_text_tokens is None else args.uncond_text_tokens
    given = {k: getattr(args, k) for k in (*SHAPE_FIELDS, "dtype", *REFINER_FIELDS)
             if getattr(args, k, None) is not None}
    admitted = admit({**given, "prompt": PLACEHOLDER_PROMPT},
                     dataclasses.replace(dep, budget=UNCHECKED), image=args.image)
    for flag, value in (("--text-tokens", args.text_tokens), ("--uncond-text-tokens", uncond)):
        if not 1 <= value <= MAX_TEXT_TOKENS:
            raise UserError(f"{flag} must be in [1, {MAX_TEXT_TOKENS}] (the text encoder keeps "
                            f"at most {MAX_TEXT_TOKENS} tokens), got {value}")
    req = admitted.request
    args.shape = {"height": req.height, "width": req.width, "num_frames": req.num_frames,
                  "fps": req.fps}
    args.dtype = req.dtype
    shape = dataclasses.replace(admitted.shape, text_tokens=(args.text_tokens, uncond))
    return dataclasses.replace(admitted, shape=shape)


#: the columns of the default table (`--wide`: every column of `_row`) and their short
#: headers, explained in `LEGEND`
NARROW = {"layout": "layout", "MoE heads/rank (+pad)": "MoE heads (+pad)",
          "busiest MoE rows/layer": "MoE rows", "MiB sent/rank/layer (MoE + Ulysses)":
          "MiB sent", "weights GiB/rank": "weights GiB", "busiest rank GiB": "busiest GiB",
          "pick": "pick"}
LEGEND = ("Per rank: MoE heads held (+ zero padding); MoE rows: the busiest rank's (token, "
          "head) rows per MoE layer; MiB sent: MoE + Ulysses all-to-all bytes per layer; "
          "weights GiB: transformer weights; busiest GiB: with the text encoder and decoders "
          "(--wide: every column).")


def format_table(plans: list[LayoutPlan], reason: str, wide: bool = False,
                 command: str = "") -> str:
    """The plan as a Markdown table (`NARROW` columns, every column with ``wide``) plus
    the recommendation: its reason and ``command``, the command that runs it. "auto" marks the
    exchange mode the MoE layer's "auto" rule picks."""
    head = (
        "layout",
        "SP x CFG x DP",
        "EP",
        "MoE exchange",
        "attn heads/rank",
        "MoE heads/rank (+pad)",
        "busiest MoE rows/layer",
        "MoE MiB sent/rank/layer",
        "Ulysses MiB sent/rank/layer",
        "MiB sent/rank/layer (MoE + Ulysses)",
        "a2a peers Uly/MoE",
        "expert GiB/rank",
        "weights GiB/rank",
        "text enc GiB (node rank 0)",
        "decoders GiB (output rank)",
        "busiest rank GiB",
        "pick",
    )
    keep = [i for i, h in enumerate(head) if wide or h in NARROW]
    shown = head if wide else tuple(NARROW.get(h, h) for h in head)
    autos = {_exchange_key(p, p.auto_exchange) for p in plans}
    rows = [shown, tuple("---" for _ in head)] + [_row(p, autos) for p in plans]
    lines = ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    if not wide:
        lines.append("\n" + LEGEND)
    best = next(p for p in plans if p.recommended)
    return "\n".join(lines) + (f"\n\nRecommended: {best.name} — {reason}.\nRun it with: "
                               f"{command or recommended_command(best)}")


def recommended_command(plan: LayoutPlan) -> str:
    """The `headmoe generate` layout flags of ``plan``'s layout (`--nproc` included; the
    flags at generate's defaults left out)."""
    return " ".join(["headmoe generate", *layout_argv(plan)])


def layout_argv(plan: LayoutPlan) -> list[str]:
    """`recommended_command`'s flags as a list."""
    par = plan.parallel
    if plan.moe_exchange != plan.auto_exchange:
        par = dataclasses.replace(par, moe_exchange=plan.moe_exchange)
    defaults = _flag_groups(flags.layout_argv(ParallelConfig()))
    given = [g for g in _flag_groups(flags.layout_argv(par)) if g[0] == "--nproc" or g not in defaults]
    return [x for g in given for x in g]


#: the ranks of one node the printed command assumes without --ranks-per-node (a node of
#: 8 GPUs); a larger world is printed as a torchrun command over several nodes
NODE_RANKS = 8
#: what the printed command generates when plan cannot know the prompt
PLACEHOLDER_PROMPT = "a red fox running through snow at dusk"
#: the printed command's --model for a preset that names no folder
PRESET_FOLDERS = {"magi2-preview": "/path/to/MAGI-2-preview"}


def run_command(args: argparse.Namespace, plan: LayoutPlan, offload: bool) -> list[str]:
    """The command line that runs ``plan`` as `plan` sized it (argv): the layout, the model,
    the request's size and frames, the dtype, the experts' format, the components' and
    layers' placement and the refiner stage; `--nproc` on one node, torchrun over ``NODE_RANKS`` (or
    ``--ranks-per-node``) ranks per node for a larger world."""
    node = args.ranks_per_node or min(args.world_size, NODE_RANKS)
    layout = layout_argv(plan)
    if node < args.world_size:
        i = layout.index("--nproc")
        del layout[i:i + 2]
        head = ["torchrun", "--nnodes", str(-(-args.world_size // node)), "--nproc-per-node",
                str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", "$HEAD:29500",
                "--rdzv-id", "job1", "$(which headmoe)"]
    else:
        head = ["headmoe"]
    model = PRESET_FOLDERS.get(args.model, args.model)
    shape = args.shape
    size = (["--resolution", args.resolution] if args.resolution is not None else
            ["--size", f"{shape['width']}x{shape['height']}"])
    argv = [*head, "generate", "--model", model, "--prompt", PLACEHOLDER_PROMPT, *size,
            "--num-frames", str(shape["num_frames"]), "--fps", f"{shape['fps']:g}",
            "--dtype", args.dtype, *layout]
    if plan.expert_format != DEFAULT_EXPERT_FORMAT:
        argv += ["--expert-format", plan.expert_format]
    for flag in ("refiner_height", "refiner_width", "refiner_steps"):
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.video_decoder != "turbo":
        argv += ["--video-decoder", args.video_decoder]
    if offload:
        argv.append("--offload")
    if args.offload_layers:
        argv.append("--offload-layers")
        if args.resident_layers:
            argv += ["--resident-layers", str(args.resident_layers)]
    return argv


def command_text(argv: list[str]) -> str:
    """``argv`` as a shell line (the `$(which headmoe)` / `$HEAD` of torchrun unquoted)."""
    import shlex

    return " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv)


def _flag_groups(flags: list[str]) -> list[list[str]]:
    """``["--a", "1", "--b"]`` -> ``[["--a", "1"], ["--b"]]``."""
    groups: list[list[str]] = []
    for x in flags:
        if x.startswith("--"):
            groups.append([x])
        else:
            groups[-1].append(x)
    return groups


def _exchange_key(p: LayoutPlan, exchange: str) -> tuple:
    par = p.parallel
    return (par.ulysses_degree, par.cfg_parallel_size, par.data_parallel_size,
            p.expert_parallel_size, exchange)


def _row(p: LayoutPlan, autos: set[tuple]) -> tuple[str, ...]:
    """One layout's cells, in the order of `format_table`'s header."""
    par = p.parallel
    auto = " (auto)" if _exchange_key(p, p.moe_exchange) in autos else ""
    named = p.name + (auto if "_group" in p.name else "")
    sent = p.moe_bytes_sent_per_rank + p.ulysses_bytes_sent_per_rank
    return (
        named,
        f"{par.ulysses_degree} x {par.cfg_parallel_size} x {par.data_parallel_size}",
        str(p.expert_parallel_size),
        p.moe_exchange + auto,
        str(p.attention_heads_per_rank),
        f"{p.moe_heads_per_rank} (+{p.padded_moe_heads})",
        f"{p.busiest_moe_rows:,}",
        f"{p.moe_bytes_sent_per_rank / MIB:,.2f}",
        f"{p.ulysses_bytes_sent_per_rank / MIB:,.2f}",
        f"{sent / MIB:,.2f}",
        f"{p.ulysses_peers}/{p.moe_peers}",
        f"{p.expert_weight_bytes_per_rank / GIB:,.2f}",
        f"{p.weight_bytes_per_rank / GIB:,.2f}",
        f"{p.text_encoder_bytes / GIB:,.2f}",
        f"{p.decoder_bytes / GIB:,.2f}",
        f"{p.busiest_rank_bytes / GIB:,.2f}",
        "**recommended**" if p.recommended else "",
    )


def format_stream_table(plans: list[LayoutPlan]) -> str:
    """The `--offload-layers` numbers of each layout as a Markdown table."""
    first = plans[0].streaming
    head = ("SP x CFG x DP", "EP", "MoE exchange", "non-layer GiB",
            f"resident layers ({first.estimate.resident_layers}) GiB",
            f"in flight ({first.estimate.slots} slots) GiB", "activations GiB",
            "device GiB/rank", "host GiB/node", "pinned GiB/rank", "GB moved/step",
            f"step >= s at {first.h2d_gbps:g} GB/s", "resident layers that fit", "pick")
    rows = [head, tuple("---" for _ in head)]
    for p in plans:
        st, e, par = p.streaming, p.streaming.estimate, p.parallel
        fit = "-" if st.max_resident_layers is None else str(st.max_resident_layers)
        rows.append((
            f"{par.ulysses_degree} x {par.cfg_parallel_size} x {par.data_parallel_size}",
            str(p.expert_parallel_size), p.moe_exchange, f"{e.non_layer_bytes / GIB:,.2f}",
            f"{e.resident_bytes / GIB:,.2f}", f"{e.in_flight_bytes / GIB:,.2f}",
            f"{st.activation_bytes / GIB:,.2f}",
            f"{st.device_bytes / GIB:,.2f}", f"{st.host_bytes_per_node / GIB:,.2f}",
            f"{e.pinned_bytes / GIB:,.2f}", f"{e.bytes_per_step / 1e9:,.1f}",
            f"{st.step_time_s:,.2f}", fit, "**recommended**" if p.recommended else ""))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def print_text(args: argparse.Namespace, model: Any, request: RequestShape, parts: Any,
               plans: list[LayoutPlan], reason: str, streamed: bool, over: bool,
               command: list[str], need: int = 0) -> None:
    """The plan as text: the request and components, the layouts table with the command
    that runs the recommendation, the streaming table (`--offload-layers`), and the note on
    components over the budget (``over``: the command has --offload for it; ``need``: the
    busiest rank's bytes then, `device_need`)."""
    image = getattr(args, "image", False)
    print(
        f"model {model.name}, world {args.world_size}, dtype {args.dtype}, "
        f"{plans[0].expert_format} routed experts; per branch "
        f"{request.video_tokens} video + {request.audio_tokens} audio + "
        f"{request.text_tokens[0]}/{request.text_tokens[1]} text tokens (cond/uncond)\n"
        f"components (device bytes when loaded): text encoder "
        f"{parts.text_encoder / GIB:,.2f} GiB on each node's first rank, {args.video_decoder} "
        f"video decoder {parts.video_decoder / GIB:,.2f} GiB + audio decoder "
        f"{parts.audio_decoder / GIB:,.2f} GiB on each output rank"
        + (f", image encoder {parts.image_encoder / GIB:,.2f} GiB on rank 0 (+"
           f"{request.image_tokens} image tokens per branch)" if image else "")
        + f"{' (offloaded to the host between uses)' if args.offload else ''}\n"
    )
    print(format_table(plans, reason, getattr(args, "wide", False), command_text(command)))
    if args.model in PRESET_FOLDERS:
        print(f"({PRESET_FOLDERS[args.model]}: the downloaded release folder; `plan --model "
              "FOLDER` reads its own configs)")
    if streamed:
        print("\nLayer streaming (--offload-layers; per rank unless marked; host: the "
              "page cache of the checkpoint's streamed bytes the node's ranks read, "
              "once, plus each rank's pinned slots):\n")
        print(format_stream_table(plans))
    if over:
        print(f"\nNote: with the text encoder and decoders on the device its busiest rank "
              f"needs {need / GIB:,.1f} GiB (weights, activations, workspace, decode and "
              f"components), over --memory-gib "
              f"{args.memory_gib:g}: the command above has --offload (components on the host "
              "between uses).")


def device_need(admitted: Admitted, dep: Deployment, plan: LayoutPlan,
                stream: StreamSettings | None) -> int:
    """Bytes the busiest rank of ``plan``'s layout needs with the components on the device:
    generate's admission estimate for that layout (`estimate_memory`: weights, activations,
    workspace, decode; the experts in ``dep.expert_format``) plus the text encoder and the
    decoders (rank 0 holds both)."""
    req = admitted.request
    est = estimate_memory(dep.model_config, admitted.shape, plan.parallel, req.torch_dtype,
                          (req.num_frames, req.height, req.width),
                          req.audio_samples(audio_vae.OUTPUT_SAMPLE_RATE), stream=stream,
                          experts=dep.expert_format)
    return est.total + plan.text_encoder_bytes + plan.decoder_bytes


def check_model_arg(args: argparse.Namespace) -> None:
    """``--model`` is a preset or a release folder (the folder then also sizes the
    components unless ``--release`` names another); `UserError` otherwise."""
    if args.model in PRESETS:
        return
    if not os.path.isdir(args.model):
        raise UserError(f"--model {args.model!r} is neither a preset ({', '.join(sorted(PRESETS))})"
                        " nor a release folder")
    args.release = args.release or args.model


def run(args: argparse.Namespace) -> int:
    """Run `plan` for parsed `args`; prints to stdout, returns the exit code."""
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise UserError(f"--world-size must be a positive number of ranks, at most "
                        f"{MAX_WORLD_SIZE:,}, got {args.world_size}, e.g. --world-size 8")
    check_model_arg(args)
    if not (math.isfinite(args.memory_gib) and 0 <= args.memory_gib <= MAX_BUDGET_GIB):
        raise UserError(f"--memory-gib must be a number of GiB in [0, {MAX_BUDGET_GIB:,}] "
                        f"(0: no limit), got {args.memory_gib!r}")
    # the one builder (a ValueError is reported by headmoe.cli.errors); each layout of the
    # sweep is this deployment with its ParallelConfig (`plan_world`)
    dep = build_deployment(flags.options_of(args, plan=True, parallel=ParallelConfig(),
                                            max_memory_gib=args.memory_gib,
                                            budget_flag="--memory-gib"))
    model = dep.model_config
    admitted = request_from_args(args, dep)
    request = admitted.shape
    if args.release is not None and not os.path.isdir(args.release):
        raise UserError(f"--release {args.release!r} is not a folder; pass the release's "
                        "root folder")
    parts = component_bytes(args.release or args.model, args.video_decoder, args.image)
    stream = stream_of(dep)
    if not args.h2d_gbps > 0:
        raise UserError(f"--h2d-gbps must be > 0 GB/s, got {args.h2d_gbps}")
    memory = dep.budget.limit
    plans, reason = plan_world(model, request, args.world_size, DTYPES[args.dtype], memory,
                               parts, args.ranks_per_node, dep.offload, stream, args.h2d_gbps,
                               dep.expert_format)
    refiner_data, refiner_text = refiner_section(args, request, plans, admitted.refiner,
                                                 dep.refiner_config)
    best = next(p for p in plans if p.recommended)
    need = device_need(admitted, dep, best, stream)
    over = memory is not None and need > memory and not args.offload
    command = run_command(args, best, args.offload or over)
    if args.json:
        print(json.dumps({
            "model": model.name, "world_size": args.world_size, "dtype": args.dtype,
            "expert_format": dep.expert_format,
            "request": request.to_dict(),
            "components": {
                "text_encoder_bytes": parts.text_encoder,
                "video_decoder": args.video_decoder,
                "video_decoder_bytes": parts.video_decoder,
                "audio_decoder_bytes": parts.audio_decoder,
                "image_encoder_bytes": parts.image_encoder,
                "offload": args.offload,
                "ranks_per_node": args.ranks_per_node or args.world_size,
            },
            "recommendation": reason, "command": command, "command_line": command_text(command),
            "layouts": [p.to_dict() for p in plans], "refiner": refiner_data}, indent=2))
        return 0
    print_text(args, model, request, parts, plans, reason, stream is not None, over, command,
               need)
    if refiner_text:
        print("\n" + refiner_text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for tests and `python -m headmoe.cli.plan`."""
    from headmoe.cli.main import Parser

    parser = Parser(prog="headmoe")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return run_guarded(lambda: args.run(args), "plan", False)


if __name__ == "__main__":
    sys.exit(main())
