"""The routed experts' weight formats by name: the one home of the names ``--expert-format``
takes (`EXPERT_FORMATS`) and of the rule that checks one (`expert_format`).

- ``"bf16"``: the release's format (`headmoe.moe.weights.Bf16Experts`: the model dtype,
  bf16 or fp32).
- ``"fp8"``: float8 E4M3 values with one fp32 scale per (head, expert) and output channel
  (`headmoe.moe.fp8_format.Fp8Experts`; the rule `headmoe.moe.fp8`; stored dtype name
  ``fp8-e4m3``, `STORED_NAMES`).

Only the routed experts change with the format: dense layers, shared and modality experts,
attention and the refiner keep the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

from headmoe.moe.fp8_format import SCALE_SUFFIX, Fp8Experts
from headmoe.moe.weights import Bf16Experts, ExpertWeights

#: the expert formats by the name ``--expert-format`` / ``expert_format`` takes
EXPERT_FORMATS: dict[str, type[ExpertWeights]] = {"bf16": Bf16Experts, "fp8": Fp8Experts}
#: the released format (every existing path's)
DEFAULT_EXPERT_FORMAT = "bf16"
#: what each format stores, as docs and messages name it
STORED_NAMES: dict[str, str] = {"bf16": "the model dtype (bf16 or fp32)", "fp8": "fp8-e4m3"}


def check_expert_format(value: object, field: str = "expert_format") -> str:
    """``value`` if it names a format of `EXPERT_FORMATS`; `ValueError` naming ``field``
    and the value otherwise."""
    if not isinstance(value, str) or value not in EXPERT_FORMATS:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, EXPERT_FORMATS))}, "
                         f"got {value!r}")
    return value


def expert_format(name: object) -> type[ExpertWeights]:
    """The `ExpertWeights` class of format ``name`` (checked by `check_expert_format`)."""
    return EXPERT_FORMATS[check_expert_format(name)]


def format_name(experts: ExpertWeights) -> str:
    """The name of the format object ``experts`` (a layer's `MultiHeadMoE.experts`)."""
    for name, cls in EXPERT_FORMATS.items():
        if type(experts) is cls:
            return name
    raise ValueError(f"expert format {type(experts).__name__} has no name in EXPERT_FORMATS")


def stored_format(names: Iterable[str]) -> str:
    """The format a checkpoint's tensor names show (``names``: an iterable of stored
    names): ``"fp8"`` when it holds an expert scale tensor (``...W_gate_scale``), else
    ``"bf16"``. The names' dtypes and shapes are checked against that format's spec afterwards."""
    suffix = Fp8Experts.NAMES[0] + SCALE_SUFFIX
    return "fp8" if any(n.endswith(suffix) for n in names) else DEFAULT_EXPERT_FORMAT


def resolve_format(given: str | None, stored: str, where: str) -> str:
    """The format a model loaded from a checkpoint whose experts are stored as ``stored``
    (`stored_format`; ``where`` names it) runs in: ``given`` (checked; None: ``stored``).
    A bf16 checkpoint runs in either format (FP8 quantizes on load); an FP8 one only in
    FP8: ``given="bf16"`` contradicts it, a `ValueError` naming the field and both."""
    if given is None:
        return stored
    check_expert_format(given)
    if stored == "fp8" and given != "fp8":
        raise ValueError(f"expert_format={given!r} contradicts {where}, whose routed experts "
                         f"are stored as {STORED_NAMES['fp8']} (leave expert_format out or "
                         "give 'fp8')")
    return given
