"""Locating ``shared/golden/<name>/`` (next to the repository root) for the component tests.

A missing folder is a test *failure*, never a skip: the golden data is the arbiter of the
decoders. ``HEADMOE_GOLDEN`` overrides the parent folder."""

from __future__ import annotations

import ast
import csv
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def golden_dir(name: str) -> Path:
    root = Path(os.environ.get("HEADMOE_GOLDEN", REPO.parent / "shared" / "golden"))
    path = root / name
    assert path.is_dir(), f"golden folder {path} is missing (set HEADMOE_GOLDEN)"
    return path


def released_tensors(name: str) -> list[dict]:
    """Rows of ``<name>/released_tensors.tsv`` with ``shape`` parsed to a tuple."""
    with open(golden_dir(name) / "released_tensors.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for row in rows:
        row["shape"] = tuple(ast.literal_eval(row["shape"]))
    return rows
