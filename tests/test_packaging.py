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
