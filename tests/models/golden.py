"""Readers of the golden MAGI-2 tensors (golden/magi2 in this repository, a copy of the released model run unmodified; MAGI2.md section 8).

Missing golden files make the tests fail (FileNotFoundError), never skip."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from headmoe.models.magi2 import BranchInput, Magi2Config
from tests.goldens import ROOT as GOLDEN_ROOT
from tests.goldens import cross_cpu_bar

GOLDEN = GOLDEN_ROOT / "magi2"
CASES = ("single_t600", "single_t200_one_text_token", "cfg_t850")
#: the bar of the golden tests (max abs, fp32; MAGI2.md section 8)
TOL = 1e-4
#: bars of quantities that move between CPUs further than the README's same-CPU bar
#: (golden/CROSS_CPU.md: a test must pass on any x86-64 CPU)
TIME_TOKENS_TOL = cross_cpu_bar("magi2", "packed.time_tokens")
LAYER_TOL = cross_cpu_bar("magi2", "trace.layer{i}_out")


def golden_config() -> Magi2Config:
    return Magi2Config.from_json(GOLDEN / "config.json")


def golden_weights() -> Path:
    path = GOLDEN / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"golden weights missing: {path}")
    return path


def load_case(name: str) -> dict[str, torch.Tensor]:
    path = GOLDEN / f"{name}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"golden case missing: {path}")
    return load_file(path)


def case_branches(d: dict[str, torch.Tensor]) -> list[BranchInput]:
    """The golden dense inputs as headmoe branches (cond first): video `[B, C, T, H, W]`
    -> `[T, H, W, C]`, text cut to its length, tau = timestep / 1000 on video and audio."""
    tau = float(d["in.timestep"][0]) / 1000.0
    out = []
    for b in range(d["in.video_latent"].shape[0]):
        n = int(d["in.text_lens"][b])
        out.append(BranchInput(
            video=d["in.video_latent"][b].permute(1, 2, 3, 0).contiguous(),
            audio=d["in.audio_latent"][b].contiguous(),
            text=d["in.text"][b, :n].contiguous(), t_video=tau, t_audio=tau,
        ))
    return out


def case_shapes() -> dict:
    return json.loads((GOLDEN / "cases.json").read_text())


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()
