"""The README's set-up command resolves with either build of torch 2.13.0.

torch 2.13.0's CUDA wheel on PyPI requires ``triton==3.7.1`` (its metadata, read with
``PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= pip install --isolated --dry-run --report r.json
torch==2.13.0 -e ".[dev]"``); the CPU build requires no triton and the interpreter tests were
run with 3.9.0. The extras' triton requirement must admit both."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement

from tests.goldens import REPO

TORCH_2_13_CUDA_TRITON = "3.7.1"
TESTED_INTERPRETER_TRITON = "3.9.0"


def _extra(name: str) -> list[Requirement]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(r) for r in data["project"]["optional-dependencies"][name]]


def test_triton_requirement_admits_both_torch_builds():
    for extra in ("gpu", "dev"):
        (triton,) = [r for r in _extra(extra) if r.name == "triton"]
        for version in (TORCH_2_13_CUDA_TRITON, TESTED_INTERPRETER_TRITON):
            assert triton.specifier.contains(version), (extra, str(triton), version)


def test_torch_requirement_admits_the_readme_pin():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    (torch,) = [Requirement(r) for r in data["project"]["dependencies"] if r.startswith("torch")]
    assert torch.specifier.contains("2.13.0")


def test_minimum_torch_is_declared_once_and_met():
    """pyproject.toml's torch requirement is `headmoe.MIN_TORCH` (transformers 5.24 needs
    2.6), the installed torch meets it, and an older one is refused in one line."""
    import pytest
    import torch

    import headmoe
    from headmoe.errors import UserError

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in data["project"]["dependencies"]
              if Requirement(r).name == "torch"]
    assert str(req.specifier) == f">={headmoe.MIN_TORCH}"
    assert req.specifier.contains(torch.__version__.split("+")[0])
    headmoe.check_torch()
    with pytest.raises(UserError, match=r"torch 2\.5\.1\+cpu is older than 2\.6"):
        headmoe.check_torch("2.5.1+cpu")


def test_a_refused_pickle_global_is_named_with_the_file(tmp_path):
    """checkpoint.ckpt stays torch.load(weights_only=True); what torch refuses is named."""
    import fractions

    import pytest
    import torch

    from headmoe.release.weights import read_tensors

    path = tmp_path / "checkpoint.ckpt"
    torch.save({"w": torch.zeros(1), "x": fractions.Fraction(1, 3)}, path)
    with pytest.raises(ValueError) as err:
        read_tensors(path)
    msg = str(err.value)
    assert f"checkpoint {str(path)!r} cannot be read with torch.load(weights_only=True)" in msg
    assert "needs the Python global fractions.Fraction" in msg, msg


def test_a_wheel_from_a_clean_tree_ships_the_web_page(tmp_path):
    """``pip install`` of a clone installs the web page of ``headmoe serve``: a wheel built
    from the files git would clone (tracked and new, not ignored ones) holds every file
    `headmoe.serve.page.FILES` serves, byte for byte."""
    import subprocess
    import sys
    import zipfile

    from headmoe.serve.page import FILES

    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "src",
                             "pyproject.toml", "README.md"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    clone = tmp_path / "clone"
    for name in listed:
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes((REPO / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                    str(clone)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("headmoe-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for name in FILES:
            shipped = zf.read(f"headmoe/serve/web/{name}")
            assert shipped == (REPO / "src/headmoe/serve/web" / name).read_bytes(), name
