"""The ``<Figure 1>`` marker of image-to-video prompts and its pooled embedding (MAGI2.md
9.1 and 9.3; golden ``magi2_pipeline`` ``prompts.json`` / ``pool_figure_tokens``).

- `ensure_figure_token`: SandAI's rule (the model authors' inference code; vLLM-Omni adds a
  newline, which headmoe does not): a prompt that parses as a JSON **object** gets
  ``reference_layer = [REFERENCE_LINE]`` (replacing any old value, re-serialised with
  ``json.dumps(..., ensure_ascii=False)``); any other prompt gets
  ``"reference_layer:" + REFERENCE_LINE`` appended with no separator.
- `figure_token_indices`: the tokens whose character span (offsets into the *normalised*
  prompt) overlaps the first occurrence of the marker; ``(0, 0)`` spans after the first
  token are skipped.
- `pool_figure_token`: the mean of those feature rows (zeros when there are none, e.g. when
  truncation cut the marker off), computed in the text features' dtype as the release does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

#: the marker of the (single) reference image
FIGURE_TOKEN = "<Figure 1>"
#: the line that points the model at the image
REFERENCE_LINE = f"The first frame refers to {FIGURE_TOKEN}"
REFERENCE_KEY = "reference_layer"


def ensure_figure_token(prompt: str) -> str:
    """``prompt`` with the figure marker (module doc; golden ``sandai_output``)."""
    try:
        value = json.loads(prompt)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        value = None
    if isinstance(value, dict):
        value[REFERENCE_KEY] = [REFERENCE_LINE]
        return json.dumps(value, ensure_ascii=False)
    return f"{prompt}{REFERENCE_KEY}:{REFERENCE_LINE}"


def figure_token_indices(
    normalized: str, offsets: Sequence[tuple[int, int]], target: str = FIGURE_TOKEN
) -> list[int]:
    """Indices of the tokens (character ``offsets`` ``[start, end)`` into ``normalized``,
    one pair per token) that overlap the first ``target`` in ``normalized``; [] when absent."""
    start = normalized.find(target)
    if start < 0:
        return []
    end = start + len(target)
    out = []
    for i, (s, e) in enumerate(offsets):
        if s == 0 and e == 0 and i != 0:
            continue
        if max(s, start) < min(e, end):
            out.append(i)
    return out


def pool_figure_token(
    features: torch.Tensor, indices: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[C]`` float32: the mean over ``indices`` of ``features`` ``[L, C]`` taken in
    ``dtype`` (the dtype the release's pipeline holds text features in); zeros when
    ``indices`` is empty."""
    if not indices:
        return features.new_zeros(features.shape[-1], dtype=torch.float32)
    rows = features.to(dtype)[list(indices)]
    return rows.mean(dim=0).float()
