"""One home for each rule: the homes docs/architecture.md names exist, and the values other
modules derive from a home are that home's (not a restated copy).

Each check imports the home and compares; the source scan left here is an `ast` one (an
integer test written inline instead of `headmoe.config.is_int`)."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import headmoe

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(headmoe.__file__).parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: the command-line subcommands a home cell may name as callers
SUBCOMMANDS = {"generate", "plan", "compare", "serve", "quantize"}
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def rule_rows(text: str) -> list[tuple[str, str]]:
    """(rule, home) of each row of the "Where each rule lives" table of ``text``."""
    section = text.split("## Where each rule lives", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("rule", "") and not set(cells[0]) <= {"-"}:
            rows.append((cells[0], cells[1]))
    return rows


def _module_of(dotted: str) -> tuple[ModuleType, list[str]] | None:
    """The longest importable module prefix of ``dotted`` and the attribute path after it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    return None


def _has(obj: object, attrs: list[str]) -> bool:
    for a in attrs:
        if not hasattr(obj, a):
            return False
        obj = getattr(obj, a)
    return True


def _defined(path: Path) -> set[str]:
    """Top-level names a module file defines, read with `ast` (the kernel modules import
    triton, which fixes its interpreter mode for the process: they are not imported)."""
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)]
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.add(node.name)
    return out


@functools.cache
def _names() -> dict[str, list[object]]:
    """Every headmoe module (by its last name), every top-level name the modules define ->
    the objects of that name; the kernel modules' and benchmarks/'s names as strings."""
    out: dict[str, list[object]] = {"headmoe": [headmoe]}
    for key, value in vars(headmoe).items():
        out.setdefault(key, []).append(value)
    for info in pkgutil.walk_packages(headmoe.__path__, "headmoe."):
        last = info.name.rsplit(".", 1)[1]
        if last.endswith("_kernels"):
            path = SRC.joinpath(*info.name.split(".")[1:]).with_suffix(".py")
            for key in {last} | _defined(path):
                out.setdefault(key, []).append(key)
            continue
        module = importlib.import_module(info.name)
        out.setdefault(last, []).append(module)
        for key, value in vars(module).items():
            out.setdefault(key, []).append(value)
    for path in (ROOT / "benchmarks").glob("*.py"):
        for key in {path.stem} | _defined(path):
            out.setdefault(key, []).append(key)
    return out


def unresolved(home: str) -> list[str]:
    """The names in backticks of a home cell that exist nowhere: a ``headmoe.*`` name must
    import (module, then attributes); a bare ``name`` or ``Name.attr`` must be a module or
    a top-level name of some headmoe module (with that attribute), or a subcommand; a path
    with ``/`` must be a file of the repository."""
    missing = []
    for name in re.findall(r"`([^`]+)`", home):
        if name.startswith("headmoe"):
            found = _module_of(name)
            if found is None or not _has(found[0], found[1]):
                missing.append(name)
        elif "/" in name:
            if not (ROOT / name.split(" ")[0]).exists():
                missing.append(name)
        elif IDENTIFIER.fullmatch(name) and name not in SUBCOMMANDS:
            first, *rest = name.split(".")
            if not any(_has(obj, rest) for obj in _names().get(first, [])):
                missing.append(name)
    return missing


def test_every_home_in_the_architecture_table_exists():
    rows = rule_rows(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(rows) > 40
    bad = {rule[:60]: names for rule, home in rows if (names := unresolved(home))}
    assert bad == {}


def test_the_table_check_sees_a_stale_home():
    text = ("## Where each rule lives\n\n| rule | home |\n|---|---|\n"
            "| a | `headmoe.config.is_int` |\n| b | `headmoe.config.no_such_rule` |\n"
            "| c | `headmoe.config` (`is_number`, `gone`) |\n| d | `benchmarks/nope.py` |\n")
    got = [unresolved(home) for _, home in rule_rows(text)]
    assert got == [[], ["headmoe.config.no_such_rule"], ["gone"], ["benchmarks/nope.py"]]


def _inline_int_checks(tree: ast.AST) -> list[int]:
    """Lines of boolean expressions that test both ``isinstance(_, int...)`` and
    ``isinstance(_, bool)``: `headmoe.config.is_int` written out again."""
    def calls(node: ast.AST) -> list[set[str]]:
        return [{n.id for n in ast.walk(sub.args[1]) if isinstance(n, ast.Name)}
                for sub in ast.walk(node)
                if isinstance(sub, ast.Call) and getattr(sub.func, "id", "") == "isinstance"
                and len(sub.args) == 2]

    def inline(node: ast.AST) -> bool:
        found = calls(node)
        return any("bool" in a and "int" in b for a in found for b in found if a is not b)

    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.BoolOp) and inline(node)]


def test_integer_check_is_written_once():
    home = SRC / "config.py"
    found = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py")) if p != home
             and (lines := _inline_int_checks(ast.parse(p.read_text(encoding="utf-8"))))}
    assert found == {}
    assert _inline_int_checks(ast.parse(home.read_text(encoding="utf-8")))  # it sees the home
    assert _inline_int_checks(ast.parse("ok = not isinstance(v, int) or isinstance(v, bool)"))
    assert not _inline_int_checks(ast.parse("ok = v is None or isinstance(v, bool | int)"))


def test_refiner_limits_and_size_are_the_request_and_preset_rules():
    from headmoe.pipeline import recipe, refine, request

    assert refine.MAX_REFINER_SIDE == request.MAX_SIDE
    assert refine.MAX_REFINER_STEPS == request.MAX_INFERENCE_STEPS
    stage = refine.RefinerStage()
    assert (stage.height, stage.width) == recipe.RESOLUTIONS["1080p"] == refine.REFINER_SIZE
    with pytest.raises(ValueError, match=f"refiner_width={request.MAX_SIDE + 16}"):
        refine.RefinerStage(width=request.MAX_SIDE + 16)


def test_load_batch_is_one_number():
    from headmoe.models.magi2 import loading
    from headmoe.models.refiner import loading as refiner_loading
    from headmoe.planner import memory

    for fn in (loading.load_checkpoint, refiner_loading.load_refiner):
        assert inspect.signature(fn).parameters["max_batch_bytes"].default \
            == loading.LOAD_BATCH_BYTES, fn.__name__
    assert memory.LOAD_BATCH_BYTES is loading.LOAD_BATCH_BYTES


def test_decoded_bytes_are_one_rule():
    """The preview's and the refiner's decode estimates are `decoded_video_bytes`."""
    import torch

    from headmoe.config import ParallelConfig
    from headmoe.models.refiner.config import get_refiner_config
    from headmoe.pipeline.latents import frame_count
    from headmoe.pipeline.refine import RefinerStage
    from headmoe.planner.memory import MemoryEstimate, decoded_video_bytes
    from headmoe.planner.refiner import stage_estimate

    cfg = get_refiner_config("tiny-refiner")
    stage = RefinerStage(64, 96, 1)
    preview = MemoryEstimate(0, 0, 0, 0)
    est = stage_estimate(cfg, stage, (3, 4, 6), 8, ParallelConfig(), torch.float32,
                         preview, offload=True)
    assert est.decode == decoded_video_bytes(frame_count(3), 64, 96)
