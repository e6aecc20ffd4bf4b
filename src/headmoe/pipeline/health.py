"""Run-time health checks of a job: non-finite values, per-layer checks, text truncation.

- `check_step(step, steps, preds)`: one reduction per predicted tensor per step (a sum is
  NaN as soon as any element is NaN or +-Inf); raises `NonFiniteError` naming the step, the
  branch and the modality. Every rank of an SP/CFG group holds the same predictions, so
  every rank fails at the same step and no rank is left waiting in a collective.
- `check_media(stage, **tensors)`: the final latents before decoding, the decoded
  video (float, before it becomes uint8: `video_latents.frames_to_uint8`) and waveform.
- `watch_layers(model)`: under ``--debug``, a forward hook on every transformer layer that
  names the first layer whose output is not finite.
- `text_report(encoder, texts, features)`: the tokens the text encoder kept per prompt, its
  limit and whether a prompt was truncated (for the sidecar and a warning).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

from headmoe.errors import NonFiniteError

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from headmoe.pipeline.interfaces import TextEncoder

BRANCHES = ("conditional", "unconditional")


class TextTokens(TypedDict):
    """An encoder's report on one text (its ``encode_with_report``): ``tokens`` before
    truncation, ``kept`` after it, ``truncated``."""

    tokens: int
    kept: int
    truncated: bool


class TextReport(TypedDict):
    """`text_report`: tokens kept and truncation per text, the encoder's limit (None: none
    reported)."""

    text_tokens: list[int]
    text_truncated: list[bool]
    text_max_tokens: int | None
_HINT = ("check the checkpoint with --check-weights, or rerun with --debug to find the first "
         "layer")
#: after a decoder: the latents were finite, so the decoder's weights are the cause it sees
DECODER_HINT = ("check the decoders' weights with --check-weights (it reads every tensor of "
                "the decoders)")
#: in the refiner stage (its input, the preview's latent, was finite)
REFINER_HINT = ("check the refiner's weights (refiner/) with --check-weights (it reads every "
                "tensor of refiner/)")
#: out of the image encoder (its input, the preprocessed image, is finite by construction)
IMAGE_ENCODER_HINT = ("check the image encoder's weights (vae/) with --check-weights (it reads "
                      "every tensor of vae/)")


def _bad(x: torch.Tensor) -> str | None:
    """None if ``x`` is finite, else "NaN" / "Inf" (one reduction; a second only on failure)."""
    if bool(torch.isfinite(x.sum(dtype=torch.float32))):
        return None
    if bool(torch.isfinite(x).all()):
        return None  # a finite tensor whose fp32 sum overflowed
    return "NaN" if bool(torch.isnan(x).any()) else "Inf"


def check_step(step: int, steps: int, preds: Sequence[tuple[torch.Tensor, torch.Tensor]],
               sigma: float | None = None) -> None:
    """Raise `NonFiniteError` if a predicted velocity ``[(video, audio)]`` per branch
    (cond, uncond) holds a NaN or Inf."""
    for b, pair in enumerate(preds):
        for modality, v in zip(("video", "audio"), pair):
            kind = _bad(v)
            if kind:
                at = f" (sigma {sigma:.4g})" if sigma is not None else ""
                raise NonFiniteError(
                    f"{kind} in the predicted {modality} velocity of the {BRANCHES[b]} branch "
                    f"at denoising step {step + 1}/{steps}{at}, {_HINT}"
                )


def check_media(stage: str, hint: str = _HINT, /, **tensors: torch.Tensor) -> None:
    """Raise `NonFiniteError` naming ``stage`` and the tensor if one holds a NaN or Inf
    (``hint``: what to do, by default the transformer's; both positional, so that any
    tensor name is free)."""
    for name, x in tensors.items():
        kind = _bad(x) if x.is_floating_point() else None
        if kind:
            raise NonFiniteError(f"{kind} in the {name} {stage}, {hint}")


def watch_layers(model: nn.Module) -> list[RemovableHandle]:
    """Forward hooks on ``model.block.layers`` raising `NonFiniteError` at the first layer
    whose output is not finite; returns the hook handles (``.remove()`` them when done)."""
    handles: list[RemovableHandle] = []
    for i, layer in enumerate(getattr(getattr(model, "block", None), "layers", ())):
        def hook(module: nn.Module, inputs: tuple[object, ...], output: torch.Tensor,
                 index: int = i) -> None:
            kind = _bad(output)
            if kind:
                raise NonFiniteError(
                    f"{kind} first appears in the output of transformer layer {index} "
                    f"({'multimodal' if getattr(module, 'multimodal', False) else 'MoE'}), "
                    "check that layer's weights with --check-weights"
                )
        handles.append(layer.register_forward_hook(hook))
    return handles


def text_report(encoder: TextEncoder, texts: Sequence[str], features: Sequence[torch.Tensor],
                counts: Sequence[TextTokens] | None = None) -> TextReport:
    """``{"text_tokens": [kept per text], "text_truncated": [bool per text],
    "text_max_tokens": limit or None}`` from what the encoder reports: `counts` (its
    ``encode_with_report`` dicts with "kept" and "truncated"), else its ``max_tokens`` and
    ``token_count(text)`` (tokens before truncation) or a ``tokenize`` returning
    ``(ids, count)``; an encoder reporting neither is taken as not truncating."""
    limit: int | None = getattr(encoder, "max_tokens", None)
    if counts is not None:
        return {"text_tokens": [int(c["kept"]) for c in counts],
                "text_truncated": [bool(c["truncated"]) for c in counts],
                "text_max_tokens": limit}
    kept: list[int] = []
    truncated: list[bool] = []
    for text, feat in zip(texts, features):
        count = None  # token_count / tokenize: optional, not in the TextEncoder protocol
        if callable(token_count := getattr(encoder, "token_count", None)):
            count = token_count(text)
        elif callable(tokenize := getattr(encoder, "tokenize", None)):
            got = tokenize(text)
            if isinstance(got, tuple) and len(got) == 2:
                count = got[1]
        kept.append(int(feat.shape[0]))
        truncated.append(bool(count is not None and limit is not None and count > limit))
    return {"text_tokens": kept, "text_truncated": truncated, "text_max_tokens": limit}


def warn_truncated(report: TextReport) -> None:
    """One warning line on stderr per truncated prompt."""
    for name, cut, kept in zip(("--prompt", "--negative-prompt"), report["text_truncated"],
                               report["text_tokens"]):
        if cut:
            print(f"headmoe: warning: {name} is longer than the text encoder's limit of "
                  f"{report['text_max_tokens']} tokens, only the first {kept} are used "
                  "(recorded as text_truncated in the sidecar)", file=sys.stderr)
