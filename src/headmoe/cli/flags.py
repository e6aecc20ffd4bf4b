"""Every flag of the command line, declared once, from the dataclass field it sets.

`FLAGS` is the table: each `Flag` names its ``dest`` (the field it sets), the owner of that
field (`ParallelConfig`, the request's fields `headmoe.admission.INPUT_FIELDS`,
`headmoe.deployment.DeploymentOptions`, or the command line itself) and its argparse
arguments. The subcommands add their flags from it (`add`), read the objects back from the
parsed namespace (`parallel_of`, `given_request`, `options_of`), and show a field as the
flag that sets it (`flag_of`; `refusal_text`: a refusal's fields, `Refusal.field`, as their
flags from the same table; `as_flags`: the scan kept for messages that carry no field).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from headmoe.admission import INPUT_FIELDS
from headmoe.config import MOE_EXCHANGES, ParallelConfig
from headmoe.deployment import DeploymentOptions
from headmoe.layers.flash_attention import ATTENTION_CHOICES, PROOF_FILE
from headmoe.models.streaming import DEFAULT_SLOTS
from headmoe.moe.formats import EXPERT_FORMATS
from headmoe.pipeline.recipe import RELEASED, RESOLUTIONS, TINY
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import DTYPES, NOISE_DEVICES
from headmoe.pipeline.sampler import SAMPLERS
from headmoe.release.folder import VIDEO_DECODERS

#: the owners a flag's field may belong to (`Flag.owner`)
LAYOUT, REQUEST, OPTIONS, COMMAND = "ParallelConfig", "request", "DeploymentOptions", "command"
#: the fields of each owner (COMMAND: flags that set no dataclass field)
OWNER_FIELDS: dict[str, tuple[str, ...]] = {
    LAYOUT: tuple(f.name for f in fields(ParallelConfig)),
    REQUEST: INPUT_FIELDS,
    OPTIONS: tuple(f.name for f in fields(DeploymentOptions)),
}
#: the layout flags are the fields of `ParallelConfig` (dest = field name)
LAYOUT_FIELDS = OWNER_FIELDS[LAYOUT]


@dataclass(frozen=True)
class Flag:
    """One flag: ``dest`` the field it sets (of ``owner``), ``kwargs`` argparse's."""

    dest: str
    owner: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    named: bool = True
    """Messages below the command line name the field (``num_frames=14``): `as_flags`
    shows it as the flag."""

    @property
    def option(self) -> str:
        """``--num-frames`` of ``num_frames``."""
        return "--" + self.dest.replace("_", "-")


def _both(name: str, fmt: Callable[[Any], str] = str) -> str:
    """"(default: X for the tiny release, Y for MAGI-2 Preview)" of a request field."""
    tiny, rel = TINY.values[name], RELEASED.values[name]
    if fmt(tiny) == fmt(rel):
        return f"(default: {fmt(tiny)})"
    return f"(default: {fmt(tiny)} for the tiny release, {fmt(rel)} for MAGI-2 Preview)"


def _plain(name: str, kind: type, what: str) -> Flag:
    """A request flag that is a field, a type and a help line (default: the recipe's)."""
    return Flag(name, REQUEST, {"type": kind, "default": None, "help": f"{what} {_both(name)}"})


_STAGE = RefinerStage()
_RESOLUTION_HELP = (
    "size preset: " + ", ".join(f"{k} = {w}x{h}" for k, (h, w) in RESOLUTIONS.items())
    + " (1080p: the 896x512 preview, then the release's refiner/ at 1920x1088 and twice the "
    "fps) (default: 540p for MAGI-2 Preview; the tiny release uses --height/--width)")

FLAGS: tuple[Flag, ...] = (
    # ---- the model (DeploymentOptions)
    Flag("model", OPTIONS, {"default": "tiny", "help": (
        "'tiny' (embedded tiny release folder, random weights; the default), a MAGI-2 "
        "Preview release folder (preview/, text_encoder/, turbo_vae/, vae/, "
        "stable-audio-open-1.0/), or a transformer checkpoint (.safetensors / "
        ".safetensors.index.json; stand-in encoders)")}),
    Flag("model_config", OPTIONS, {"default": None, "help": (
        "transformer configuration: a preset (tiny, magi2-preview) or a JSON file in the "
        "public MAGI-2 config schema (default: a checkpoint file's config.json next to it; a "
        "release folder's preview/config.json, or magi2-preview where it has none, as "
        "published)")}),
    Flag("video_decoder", OPTIONS, {"choices": VIDEO_DECODERS, "default": None, "help": (
        "release folders: the distilled TurboV3 decoder (turbo_vae/, default) or the full "
        "Wan2.2 VAE (vae/)")}),
    Flag("offload", OPTIONS, {"action": "store_true", "help": (
        "release folders: keep the text encoder and decoders on the host between uses "
        "(moved to the device only while they run)")}),
    Flag("offload_layers", OPTIONS, {"action": "store_true", "help": (
        "stream each rank's transformer layer weights from the checkpoint's files, "
        f"{DEFAULT_SLOTS} layers on the device at a time (docs/guide.md, 'Fewer GPUs')")}),
    Flag("resident_layers", OPTIONS, {"type": int, "default": 0, "help": (
        "with --offload-layers: keep the first N layers on the device (spare memory, fewer "
        "bytes moved per step; default 0)")}),
    Flag("expert_format", OPTIONS, {"choices": tuple(EXPERT_FORMATS), "default": None, "help": (
        "routed experts' weights (95%% of MAGI-2 Preview's): bf16, the release's, or fp8, "
        "float8 E4M3 with an fp32 scale per expert and output channel (docs/fp8.md): 51%% of "
        "the expert bytes, each weight rounded to 4 significant bits (up to 2^-4 relative "
        "error); quantized on load from a bf16 release (each rank its own heads, one tensor at "
        "a time), or read from a 'headmoe quantize' folder (default: the checkpoint's own "
        "format)")}),
    Flag("attention", OPTIONS, {"choices": ATTENTION_CHOICES, "default": "auto", "help": (
        "attention kernel on CUDA ranks: triton (headmoe's sink kernel), flash (torch's "
        "FlashAttention-2 with the sink applied from its log-sum-exp), auto: flash once "
        f"benchmarks/gpu_check.py has recorded its invariance for this GPU and torch/CUDA/"
        f"cuDNN in <cache-dir>/{PROOF_FILE}, else triton (default: auto; CPU ranks run the "
        "torch definition, and refuse flash)")}),
    Flag("cuda_graphs", OPTIONS, {"action": "store_true", "help": (
        "capture the denoise step as CUDA graphs (docs/model.md, 'CUDA graphs'): refused "
        "on CPU ranks, with --offload-layers and on more than one rank; the transformer "
        "forward is not captured yet (benchmarks/gpu_check.py section k measures a "
        "sync-free step; default: off)")}),
    Flag("cache_dir", OPTIONS, {"default": "~/.cache/headmoe", "help": (
        "where the tiny release folder is written once (default: ~/.cache/headmoe)")}, named=False),
    # ---- the request (admission's input fields)
    Flag("prompt", REQUEST, {"default": None, "help": (
        "UTF-8 text, raw (no template); the text encoder's token limit applies (truncation "
        "is warned about and recorded in the sidecar)")}),
    Flag("negative_prompt", REQUEST, {"default": None, "help": (
        "text of the unconditional branch (default: headmoe's short list for the tiny "
        "release, the released 1,721-character text for MAGI-2 Preview)")}),
    Flag("resolution", REQUEST, {"default": None, "help": _RESOLUTION_HELP,
                                 "metavar": "{" + ",".join(RESOLUTIONS) + "}"}),
    Flag("size", REQUEST, {"default": None, "metavar": "WxH", "help": (
        "width x height in pixels, e.g. 896x512 (the HTTP API's size field)")}),
    _plain("height", int, "pixels, a multiple of 16"),
    _plain("width", int, "pixels, a multiple of 16"),
    _plain("num_frames", int, "output frames, of the form 4k+1"),
    _plain("fps", float, "frame rate"),
    _plain("num_inference_steps", int, "denoising steps"),
    _plain("seed", int, "noise seed; data-parallel group k uses seed + k"),
    _plain("guidance_scale", float, "video CFG scale"),
    _plain("audio_guidance_scale", float, "audio CFG scale"),
    _plain("shift", float, "flow-matching time shift"),
    Flag("seconds", REQUEST, {"type": float, "default": None, "help": (
        "clip length; num_frames = the largest 4k+1 <= seconds x fps (the release makes 10 s "
        "= 125 frames at 12.5 fps; other lengths are headmoe's extension, noted in the "
        "sidecar) (default: 10 for MAGI-2 Preview; the tiny release uses --num-frames)")}),
    Flag("sampler", REQUEST, {"choices": SAMPLERS, "default": None, "help": (
        "unipc: the released scheduler (docs/pipeline.md section 3) " + _both("sampler"))}),
    Flag("dtype", REQUEST, {"choices": tuple(DTYPES), "default": None, "help": (
        "transformer dtype (default: fp32 for the tiny release; MAGI-2 Preview: bf16 on a "
        "GPU, fp32 on a CPU)")}),
    Flag("noise_device", REQUEST, {"choices": NOISE_DEVICES, "default": None, "help": (
        "generator of the initial noise: cpu gives the same bytes on every layout and "
        "machine; cuda draws on the GPU as the reference does (values depend on the GPU "
        f"model) {_both('noise_device')}")}),
    Flag("refiner_height", REQUEST, {"type": int, "default": None, "help": (
        "run the release's refiner (refiner/) after the preview, at this height in pixels (a "
        f"multiple of 16; default {_STAGE.height}, or the --resolution preset's); the clip "
        "gets 2T-1 latent frames at twice the fps")}),
    Flag("refiner_width", REQUEST, {"type": int, "default": None, "help": (
        f"refiner width in pixels (a multiple of 16; default {_STAGE.width})")}),
    Flag("refiner_steps", REQUEST, {"type": int, "default": None, "help": (
        f"refiner sampler steps (default {_STAGE.steps})")}),
    # ---- the layout (ParallelConfig)
    Flag("ulysses_degree", LAYOUT, {"type": int, "default": 1, "help": (
        "SP: ranks that share one sequence (Ulysses) (default: 1)")}),
    Flag("cfg_parallel_size", LAYOUT, {"type": int, "default": 1, "help": (
        "1: both CFG branches in one forward; 2: one branch per SP group (default: 1)")}),
    Flag("data_parallel_size", LAYOUT, {"type": int, "default": 1, "help": (
        "independent requests; group k writes <stem>.dp<k>.mp4 (default: 1)")}),
    Flag("enable_expert_parallel", LAYOUT, {"action": "store_true", "help": (
        "shard the MoE layers' heads over EP ranks of the SP group")}),
    Flag("expert_parallel_size", LAYOUT, {"type": int, "default": None, "help": (
        "EP degree (divides --ulysses-degree); default: the SP group")}),
    Flag("moe_exchange", LAYOUT, {"choices": MOE_EXCHANGES, "default": "auto", "help": (
        "where MoE tokens are exchanged: ep_group, sp_group or auto (the MoE layer's rule, "
        "docs/parallelism.md) (default: auto)")}),
    # ---- how the ranks run (DeploymentOptions)
    Flag("nproc", OPTIONS, {"type": int, "default": None, "help": (
        "local ranks to start (default: the layout's world size); not used under torchrun")}, named=False),
    Flag("timeout", OPTIONS, {"type": float, "default": 60.0, "help": (
        "seconds any collective may wait before the job fails and the rank that stopped "
        "responding is named (default: 60)")}),
    Flag("max_memory_gib", OPTIONS, {"type": float, "default": None, "help": (
        "memory one rank may use, replacing the detected limit (free device memory, or "
        "available host memory / local ranks on CPU); 0: no check")}, named=False),
    Flag("max_time", OPTIONS, {"type": float, "default": None, "metavar": "SECONDS"}),
    # ---- generate's command-line flags
    Flag("prompt_file", COMMAND, {"default": None, "help": (
        "read the prompt from this UTF-8 file (instead of --prompt)")}, named=False),
    Flag("samples", COMMAND, {"default": None, "metavar": "FILE", "help": (
        "several requests on one model load: a JSON lines file, one request per line (the "
        "request flags' fields as JSON keys, plus image and output); every line is admitted "
        "before any runs; line N writes <output stem>.N.mp4 unless it gives output "
        "(docs/guide.md, 'Several prompts')")}, named=False),
    Flag("image", COMMAND, {"default": None, "metavar": "PATH", "help": (
        "image-to-video: a PNG, JPEG or WebP file whose content becomes the first frame "
        "(release folders; the prompt gets the <Figure 1> marker)")}, named=False),
    Flag("output", COMMAND, {"default": "output.mp4", "help": (
        "mp4 path; sidecar: .json next to it (default: output.mp4)")}),
    Flag("no_progress", COMMAND, {"action": "store_true", "help": "no progress bar"}, named=False),
    Flag("overwrite", COMMAND, {"action": "store_true", "help": (
        "replace an existing --output file (default: refuse)")}, named=False),
    # ---- serve's command-line flags
    Flag("state_dir", COMMAND, {"default": None, "metavar": "DIR", "help": (
        "the job database's folder (jobs.sqlite3): jobs survive a restart (docs/serving.md "
        "section 5) (default: beside --output-dir, its name plus '-state')")}, named=False),
    Flag("check_weights", COMMAND, {"action": "store_true", "help": (
        "read every tensor of the transformer checkpoint (and of a release's text encoder "
        "and video and audio decoders) first and refuse NaN/Inf values")}, named=False),
)
#: the flags of serve alone (generate takes every other flag of `FLAGS`)
SERVE_ONLY = ("state_dir",)
#: dest -> its flag
BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
#: the field a refusal names that no flag of its own sets, and the flag that sets it
ALIASES: dict[str, str] = {"world_size": "--nproc"}


def time_help(default: float | None) -> str:
    """``--max-time``'s help line with its command's default."""
    return ("refuse a request whose time estimate (printed before the ranks start) is over "
            "this many seconds; 0: no check (default: "
            f"{'none' if default is None else f'{default:g}'})")


def add(p: argparse.ArgumentParser | Any, *dests: str, **override: dict[str, Any]) -> None:
    """Add the flags of ``dests`` to ``p`` from `FLAGS` (``override[dest]``: the arguments
    a command changes, e.g. serve's ``--timeout`` default)."""
    for dest in dests:
        flag = BY_DEST[dest]
        kwargs = {**flag.kwargs, **override.get(dest, {})}
        aliases = kwargs.pop("aliases", ())
        p.add_argument(flag.option, *aliases, dest=dest, **kwargs)


def flag_of(name: str) -> str:
    """The flag that sets field ``name`` (`FLAGS`), e.g. ``--num-frames``; `KeyError` for a
    field no flag sets."""
    if name in ALIASES:
        return ALIASES[name]
    return BY_DEST[name].option


def refusal_flags(field_names: str) -> list[str]:
    """The flags of a `Refusal.field` (one field or several, comma-separated)."""
    return [flag_of(n) for n in field_names.split(",") if n in BY_DEST or n in ALIASES]


def _quoted_errors(text: str) -> list[tuple[int, int]]:
    """The spans of another library's error quoted in ``text``, "(RuntimeError: ...)":
    its words are not our fields."""
    spans, i = [], text.find("(")
    while i >= 0:
        end, j = text.find(")", i), i + 1
        while j < len(text) and (text[j].isalnum() or text[j] == "_"):
            j += 1
        name = text[i + 1:j]
        if end > i and name[:1].isupper() and name.endswith(
                ("Error", "Exception", "Warning", "Fault")):
            spans.append((i, end + 1))
            i = text.find("(", end)
        else:
            i = text.find("(", i + 1)
    return spans


#: characters after which a field name starts a word
_BEFORE = " \t\n(,'\""


def refusal_text(field_names: str, text: str) -> str:
    """A `Refusal`'s message ``text`` as the command line shows it: each field of its
    ``field_names`` (`Refusal.field`) written ``name=`` becomes its flag from the table
    (`refusal_flags`, no scan); then `as_flags` shows the fields the message names besides
    its own (the ``fps=`` of a seconds/num_frames contradiction, the ``max_time=`` of the
    time limit)."""
    own = [n for n in field_names.split(",") if n in BY_DEST or n in ALIASES]
    flags = dict(zip(own, refusal_flags(field_names), strict=True))
    text = _scan(text, sorted(own, key=len, reverse=True), flags.__getitem__, "=")
    return as_flags(text, assignments_only=True)


def as_flags(text: str, assignments_only: bool = False) -> str:
    """``text`` with each field of `FLAGS` written ``name=`` (and, unless
    ``assignments_only``, a leading or free-standing ``name ``) shown as its flag; not inside
    another library's error quoted in parentheses. A scan of the text: for the errors that
    carry no `Refusal.field` (the ValueErrors of the layers below the command line that
    name a field: `headmoe.deployment.build_deployment`'s, the release folder's checks,
    `ParallelConfig`'s and `headmoe.pipeline.deployment.check_timeout`'s) and for the fields
    a refusal's message names besides its own (`refusal_text`)."""
    names = sorted((*(f.dest for f in FLAGS if f.named), *ALIASES), key=len, reverse=True)
    return _scan(text, names, flag_of, "=" if assignments_only else "= ")


def _scan(text: str, names: Sequence[str], flag_for: Callable[[str], str],
          follow: str) -> str:
    """``text`` with each of ``names`` (longest first) at a word's start and followed by a
    character of ``follow`` shown as ``flag_for(name)``; text inside another library's error
    quoted in parentheses is kept as it is."""
    quoted = _quoted_errors(text)
    out, i = [], 0
    while i < len(text):
        span = next((s for s in quoted if s[0] == i), None)
        if span is not None:
            out.append(text[span[0]:span[1]])
            i = span[1]
            continue
        if i == 0 or text[i - 1] in _BEFORE:
            hit = next((n for n in names if text.startswith(n, i)
                        and text[i + len(n):i + len(n) + 1] in tuple(follow)), None)
            if hit is not None:
                out.append(flag_for(hit))
                i += len(hit)
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def parallel_of(args: argparse.Namespace) -> ParallelConfig:
    """The layout the flags give (the flags are `ParallelConfig`'s fields)."""
    return ParallelConfig(**{name: getattr(args, name) for name in LAYOUT_FIELDS})


def given_request(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the flags give (those not None), ``prompt`` included when read."""
    return {k: getattr(args, k) for k in INPUT_FIELDS if getattr(args, k, None) is not None}


def options_of(args: argparse.Namespace, **fixed: Any) -> DeploymentOptions:
    """The `DeploymentOptions` of the parsed flags: every option field a flag of ``args``
    sets, the layout, and the ``fixed`` fields the command sets itself."""
    given = {n: getattr(args, n) for n in OWNER_FIELDS[OPTIONS]
             if n in BY_DEST and BY_DEST[n].owner == OPTIONS and hasattr(args, n)}
    if "parallel" not in fixed and not fixed.get("config_only"):
        given["parallel"] = parallel_of(args)
    return DeploymentOptions(**{**given, **fixed})


def layout_argv(parallel: ParallelConfig) -> list[str]:
    """`generate` flags of a layout, `--nproc` included: one flag per `ParallelConfig` field
    (the layout flags are its fields); a False switch and a None value are left out."""
    argv: list[str] = []
    for name in LAYOUT_FIELDS:
        value, flag = getattr(parallel, name), BY_DEST[name].option
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv + [BY_DEST["nproc"].option, str(parallel.world_size)]


def dests(owner: str) -> Iterable[str]:
    """The dests of the flags of ``owner``, in table order."""
    return (f.dest for f in FLAGS if f.owner == owner)
