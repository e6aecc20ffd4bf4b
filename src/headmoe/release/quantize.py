"""`quantize_release`: a release folder whose ``preview/`` holds the routed experts in FP8
(``headmoe quantize --model RELEASE --output DIR``; docs/fp8.md).

The output has the release's layout: ``preview/`` gets the FP8 experts (each
``...mlp.moe_mlp.W_gate / W_up / W_down`` as float8_e4m3fn values plus its
``..._scale`` fp32 tensor, `headmoe.moe.fp8.quantize`) and every other tensor as stored,
in safetensors shards of at most `SHARD_BYTES` with an index; ``preview/config.json`` and
every other file of the source folder (text encoder, decoders, refiner, ...) are hard-linked,
or copied where the file system cannot link. The source is untrusted: every entry is a
regular file inside it (`headmoe.files.entry_problem`; links out of it are refused, the
Hugging Face cache's snapshot links excepted), its checkpoint is read through its index
(shards confined to the folder) after every header is checked (`check_release`). The
output is built in a temp folder beside ``output`` and renamed in one step, then checked as a
release folder whose experts are FP8; an existing non-empty ``output`` is refused.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headmoe.errors import RuntimeFault, UserError
from headmoe.files import entry_problem, temp_path
from headmoe.models.magi2.loading import INDEX_SUFFIX, MOE_MARKER, check_checkpoint
from headmoe.moe.formats import STORED_NAMES
from headmoe.moe.fp8 import quantize
from headmoe.moe.fp8_format import SCALE_SUFFIX, VALUES
from headmoe.release.folder import PREVIEW_DIR, Release, check_release, find_release

#: the most bytes of tensors one output shard holds (and the host holds while writing it)
SHARD_BYTES = 2 << 30
#: the output checkpoint's index, under preview/
FP8_INDEX = "model-fp8" + INDEX_SUFFIX

Progress = Callable[[str], None]


def quantize_release(source: str | os.PathLike[str], output: str | os.PathLike[str],
                     progress: Progress = lambda _: None, shard_bytes: int = SHARD_BYTES
                     ) -> Path:
    """Write ``source``'s release with FP8 routed experts to ``output`` (see the module
    docstring) and return the output folder. Raises `UserError` naming ``output`` (exists,
    not empty) or the source's refused file or tensor before anything is written."""
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {str(out)!r} exists and is not an empty folder; pick a new "
                        "path (quantize never replaces files)")
    release = check_release(find_release(source))
    if release.expert_format != "bf16":
        raise UserError(f"--model {str(source)!r}: its preview/ already stores "
                        f"{release.expert_format} experts; quantize reads a bf16 release")
    base = Path(release.root)
    entries = _source_entries(base, Path(release.transformer))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    try:
        tmp.mkdir()
        for i, (rel, real) in enumerate(entries):
            _link_or_copy(real, tmp / rel)
            if i % 50 == 0 or i == len(entries) - 1:
                progress(f"linked {i + 1}/{len(entries)} files of the other components")
        write_fp8_checkpoint(release, tmp / PREVIEW_DIR / FP8_INDEX, progress, shard_bytes)
        found = check_release(find_release(tmp))
        assert found.expert_format == "fp8", found.expert_format  # the headers show it
        _publish_folder(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    progress(f"wrote {str(out)!r}")
    return out


def _source_entries(base: Path, transformer: Path) -> list[tuple[str, str]]:
    """(relative name, resolved file) of every file of the release but the preview
    checkpoint (its index and shards, rewritten); a link that leaves the folder, a linked
    folder or a FIFO is refused by name."""
    skip = {transformer.resolve()}
    if transformer.name.endswith(INDEX_SUFFIX):
        with open(transformer) as f:
            weight_map = json.load(f).get("weight_map", {})
        skip |= {(transformer.parent / s).resolve() for s in set(weight_map.values())}
    out, problems = [], []
    for folder, dirs, files in os.walk(base):
        for d in dirs:
            if os.path.islink(os.path.join(folder, d)):
                problems.append(f"{os.path.relpath(os.path.join(folder, d), base)} (a linked "
                                "folder)")
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(folder, name), base)
            why, real = entry_problem(base, rel)
            if why is not None:
                problems.append(f"{rel} ({why})")
            elif Path(os.path.join(base, rel)).resolve() not in skip:
                out.append((rel, real))
    if problems:
        raise UserError(f"release folder {str(base)!r}: entries must be regular files inside "
                        "the folder: " + ", ".join(sorted(problems)))
    return sorted(out)


def _link_or_copy(real: str, dst: Path) -> None:
    """Hard-link ``real`` at ``dst`` (its folders made), or copy it across file systems."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(real, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copyfile(real, dst)


def _publish_folder(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` in one step (``out`` absent or an empty folder)."""
    try:
        os.replace(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise RuntimeFault(f"{str(out)!r} was filled by another program while quantize "
                               "ran; it was kept and this run's folder dropped") from None
        raise


def _expert_value(name: str) -> bool:
    """``name`` (prefix stripped) is a routed expert's bf16 weight that FP8 replaces."""
    return MOE_MARKER in name and name.rsplit(".", 1)[-1] in VALUES


def write_fp8_checkpoint(release: Release, index: Path, progress: Progress,
                         shard_bytes: int = SHARD_BYTES) -> None:
    """The FP8 checkpoint of ``release``'s (a checked `Release`) transformer at ``index``
    (a ``*.safetensors.index.json``) and its shards ``model-fp8-0000i.safetensors``: the
    expert weights quantized (values float8_e4m3fn `[rows, K, N]`, scales ``_scale`` fp32
    `[rows, N]`), every other tensor as stored; one source tensor and at most
    ``shard_bytes`` of output in memory at a time. The stored names keep their prefix."""
    headers, report = check_checkpoint(release.model_config, release.transformer)
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in headers.items():
        by_file.setdefault(file, []).append(name)
    index.parent.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, str] = {}
    held, done, total, size = 0, 0, len(headers), 0

    def flush() -> None:
        nonlocal held
        if shards[-1]:
            file = f"{index.name.removesuffix(INDEX_SUFFIX)}-{len(shards):05d}.safetensors"
            save_file(shards[-1], str(index.parent / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shards[-1], file))
            shards.append({})
        held = 0

    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                stored = report.prefix + name
                t = f.get_tensor(stored)
                parts = ({stored: t} if not _expert_value(name) else
                         _quantized(stored, t))
                for k, v in parts.items():
                    shards[-1][k] = v
                    held += v.numel() * v.element_size()
                    size += v.numel() * v.element_size()
                done += 1
                if held >= shard_bytes:
                    flush()
                    progress(f"preview/: {done}/{total} tensors quantized or copied")
    flush()
    progress(f"preview/: {total}/{total} tensors quantized or copied, {len(shards) - 1} "
             "shard(s)")
    with open(index, "w") as fh:
        json.dump({"metadata": {"total_size": size, "expert_format": STORED_NAMES["fp8"]},
                   "weight_map": weight_map}, fh, indent=1)


def _quantized(stored: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """{stored: FP8 values, stored + "_scale": fp32 scales} of expert weight ``w``."""
    q = quantize(stored, w)
    return {stored: q.data.contiguous(), stored + SCALE_SUFFIX: q.scale.contiguous()}
