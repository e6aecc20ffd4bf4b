"""Readers of the golden refiner tensors (golden/magi2_refiner: SandAI's own refiner,
packing, scheduler and loop run unmodified on CPU with a tiny configuration; its README
lists every tensor and tolerance). Missing files fail the tests, never skip them."""

from __future__ import annotations

import ast
import csv
import json

import torch
from safetensors.torch import load_file

from headmoe.models.refiner import Magi2Refiner, Magi2RefinerConfig, load_refiner
from tests.goldens import golden_file

NAME = "magi2_refiner"
FORWARD_CASES = ("forward_masked", "forward_one_text_token")
#: the README's bars
TOL = 1e-4
ROPE_TOL = 1e-6
BF16_MAX, BF16_RMS = 0.1, 1e-2


def golden_json(rel: str) -> dict:
    return json.loads(golden_file(NAME, rel).read_text())


def golden_config() -> Magi2RefinerConfig:
    return Magi2RefinerConfig.from_dict(golden_json("config.json")["arch"], name="golden")


def golden_model(dtype: torch.dtype = torch.float32, **kwargs) -> Magi2Refiner:
    model = Magi2Refiner(golden_config(), dtype=dtype, **kwargs)
    load_refiner(model, golden_file(NAME, "model.safetensors"))
    return model


def load_case(name: str) -> dict[str, torch.Tensor]:
    return load_file(golden_file(NAME, f"{name}.safetensors"))


def released_rows() -> list[tuple[str, tuple[int, ...], str]]:
    with open(golden_file(NAME, "refiner_tensors.tsv"), newline="") as f:
        return [(r["name"], tuple(ast.literal_eval(r["shape"])), r["dtype"])
                for r in csv.DictReader(f, delimiter="\t")]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def dense_mask_from_rectangles(q_ranges: torch.Tensor, k_ranges: torch.Tensor, n: int
                               ) -> torch.Tensor:
    """`[n, n]` bool: the union of upstream's (q range x k range) rectangles."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for (qa, qb), (ka, kb) in zip(q_ranges.tolist(), k_ranges.tolist()):
        mask[qa:qb, ka:kb] = True
    return mask
