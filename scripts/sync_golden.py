#!/usr/bin/env python3
"""Refresh the repository's copy of the golden reference data from ``../shared/golden``.

The tests read ``golden/`` inside the repository (a user's clone has no ``../shared``);
this script replaces it with the shared copy and writes ``golden/MANIFEST.sha256`` (one
``<sha256>  <relative path>`` line per file, sorted), which ``tests/test_golden_copy.py``
checks on every run.

Usage: python scripts/sync_golden.py [--source DIR]   (default: <repo>/../shared/golden)
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEST = REPO / "golden"
MANIFEST = "MANIFEST.sha256"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_lines(root: Path) -> list[str]:
    """``<sha256>  <path>`` for every file under ``root`` but the manifest, sorted by path."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    return [f"{sha256(p)}  {p.relative_to(root).as_posix()}" for p in files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=REPO.parent / "shared" / "golden")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        print(f"sync_golden: source folder {args.source} does not exist", file=sys.stderr)
        return 2
    tmp = DEST.with_name("golden.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(args.source, tmp, symlinks=False)
    (tmp / MANIFEST).write_text("\n".join(manifest_lines(tmp)) + "\n")
    shutil.rmtree(DEST, ignore_errors=True)
    tmp.rename(DEST)
    print(f"sync_golden: {DEST} refreshed from {args.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
