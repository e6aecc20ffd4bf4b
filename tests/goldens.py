"""The one place tests find golden reference data: ``golden/<name>/`` in this repository.

``golden/`` is a copy of ``../shared/golden`` (public implementations of the released
model run unmodified; each folder's README says how and at which tolerances), refreshed by
``scripts/sync_golden.py``; ``tests/test_golden_copy.py`` checks it. A missing folder or
file is a test *failure*, never a skip."""

from __future__ import annotations

import ast
import csv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "golden"
#: where the shared original lives next to a CI clone (absent in a user's clone)
SHARED = REPO.parent / "shared" / "golden"


def golden_dir(name: str) -> Path:
    """``golden/<name>`` of this repository; an assertion error when it is missing."""
    path = ROOT / name
    assert path.is_dir(), f"golden folder {path} is missing (run scripts/sync_golden.py)"
    return path


def golden_file(name: str, rel: str) -> Path:
    """``golden/<name>/<rel>``; an assertion error when it is missing."""
    path = golden_dir(name) / rel
    assert path.is_file(), f"golden file {path} is missing (run scripts/sync_golden.py)"
    return path


def released_tensors(name: str) -> list[dict]:
    """Rows of ``<name>/released_tensors.tsv`` with ``shape`` parsed to a tuple."""
    with open(golden_file(name, "released_tensors.tsv"), newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for row in rows:
        row["shape"] = tuple(ast.literal_eval(row["shape"]))
    return rows


def _cell(text: str) -> str:
    return text.strip().replace("`", "")


def cross_cpu_bar(name: str, quantity: str) -> float:
    """The cross-CPU bar of ``golden/CROSS_CPU.md`` for ``quantity`` of set ``name`` (the
    table's first two columns, backticks dropped): the max abs a test asserts so that it
    passes on any x86-64 CPU. The table is the one home of these numbers; a missing row or
    a row without a number is an assertion error."""
    import re

    path = ROOT / "CROSS_CPU.md"
    assert path.is_file(), f"{path} is missing (run scripts/sync_golden.py)"
    for line in path.read_text().splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) == 5 and _cell(cells[0]) == name and _cell(cells[1]) == quantity:
            found = re.search(r"<=\s*([0-9.]+e-?[0-9]+)", cells[4])
            assert found, f"CROSS_CPU.md row {name} / {quantity} names no bar: {cells[4]!r}"
            return float(found.group(1))
    raise AssertionError(f"CROSS_CPU.md has no row for {name} / {quantity}")
