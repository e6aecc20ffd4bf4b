"""Image-to-video conditioning: the ``<Figure 1>`` marker of the prompt, its pooled embedding
and the encoded image (MAGI2.md 9.1, 9.3, 9.4; golden ``magi2_pipeline`` ``prompts.json`` /
``pool_figure_tokens``; the packing itself is `headmoe.models.magi2.packing`'s).

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
- `image_condition`: the image's latent (`ImageEncoder`, once per request on one rank) and
  the pooled token, which both CFG branches carry (`ImageCondition`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from headmoe.pipeline.image import ReferenceImage
    from headmoe.pipeline.interfaces import Components, FigureTextEncoder

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


@dataclass(frozen=True)
class ImageCondition:
    """What the image adds to both CFG branches: the clean latent ``[h, w, C_video]`` and
    the ``<Figure 1>`` embedding ``[C_text]`` pooled from the positive prompt (the
    unconditional branch carries the same two, as the release's ``use_ref_for_uncond``)."""

    latent: torch.Tensor
    token: torch.Tensor

    def branch_fields(self) -> dict[str, torch.Tensor]:
        """The `BranchInput` fields ``image`` and ``image_token``."""
        return {"image": self.latent, "image_token": self.token}


def image_condition(parts: Components, image: ReferenceImage, prompt: str, features: torch.Tensor,
                    dtype: torch.dtype) -> ImageCondition:
    """Encode ``image`` (`parts.image_encoder`, once, broadcast) and pool the marker of
    ``prompt`` (already through `ensure_figure_token`) over its ``features`` ``[L, C]``;
    ``dtype`` is the transformer's (the release pools the text features in it). Every rank
    of the world calls it together."""
    if parts.image_encoder is None:
        raise ValueError("this model has no image encoder (a release folder's "
                         "vae/Wan2.2_VAE.pth); image-to-video needs one")
    latent = parts.image_encoder.encode(image)
    # an image model's text encoder finds the marker (`FigureTextEncoder`)
    indices = cast("FigureTextEncoder", parts.text_encoder).figure_indices(prompt)
    return ImageCondition(latent, pool_figure_token(features, indices, dtype))
