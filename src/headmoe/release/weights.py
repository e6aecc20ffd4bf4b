"""Safe reading and strict checking of component checkpoints (decoders, encoders).

Only two readers exist: safetensors files, and torch pickles read with
``torch.load(weights_only=True, mmap=True)`` (no arbitrary code runs). Every check reports
all missing, unexpected and mis-shaped tensors by name before anything is loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch
from safetensors import SafetensorError, safe_open

from headmoe.files import listing


def open_safetensors(path: str | os.PathLike):
    """``safe_open(path, framework="pt")``; a missing or corrupt file raises `ValueError`
    naming it (instead of safetensors' own error, which does not)."""
    path = os.fspath(path)
    try:
        return safe_open(path, framework="pt")
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path!r} is not a readable safetensors file: {exc}") from None


def read_tensors(path: str | os.PathLike) -> dict[str, object]:
    """The top-level object of a checkpoint file as a dict.

    ``*.safetensors`` -> ``{name: tensor}`` (CPU). Anything else is read as a torch pickle
    with ``weights_only=True, mmap=True`` (tensors stay memory-mapped), which must hold a
    dict. Raises `ValueError` naming the file if it cannot be read safely."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path!r} does not exist")
    if path.endswith(".safetensors"):
        with open_safetensors(path) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # pickle with non-tensor objects, truncated file, ...
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        why = (f"it needs the Python global {found.group(1)}, which torch {torch.__version__} "
               "refuses to unpickle" if found else " ".join(str(exc).split())[:300])
        raise ValueError(
            f"checkpoint {path!r} cannot be read with torch.load(weights_only=True): {why}; "
            "headmoe never unpickles arbitrary objects: save its state dict alone "
            "(or as safetensors)"
        ) from exc
    if not isinstance(obj, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(obj).__name__}, expected a dict")
    return obj


def check_tensors(
    found: Mapping[str, torch.Tensor | torch.Size | tuple[int, ...]],
    expected: Mapping[str, torch.Size | tuple[int, ...]],
    source: str,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Raise `ValueError` naming every missing, unexpected and mis-shaped tensor.

    ``found`` maps names to tensors or shapes, ``expected`` names to shapes; ``source``
    (a file name) prefixes the message. ``aliases`` (optional) maps a found name to the
    name the file spells it with; messages then give ``file_name (name)``."""
    aliases = aliases or {}

    def show(n: str) -> str:
        return f"{aliases[n]} ({n})" if n in aliases else n

    def shape(v: object) -> list[int]:
        return list(v.shape) if isinstance(v, torch.Tensor) else list(v)  # type: ignore[arg-type]

    missing = [n for n in expected if n not in found]
    unexpected = sorted(show(n) for n in found if n not in expected)
    bad = [
        f"{show(n)}: expected {list(expected[n])}, found {shape(found[n])}"
        for n in expected
        if n in found and shape(found[n]) != list(expected[n])
    ]
    problems = [listing(kind, items) for kind, items in (
        ("missing tensors", missing), ("unexpected tensors", unexpected),
        ("mis-shaped tensors", bad)) if items]
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))

