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
