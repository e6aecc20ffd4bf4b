"""Packing MAGI-2 requests into one token sequence (MAGI2.md section 2) and back.

Notation: T packed tokens; a branch is one CFG branch (cond or uncond) of one request;
its tokens are `[video (t, h, w row-major) | audio | text]`, and branches are concatenated
(one attention segment each, `cu_seqlens`). An image-to-video branch (MAGI2.md 9.4) adds,
after its text, one special-token row (modality text, the pooled `<Figure 1>` embedding,
coords `(T+2, -1, -1, 1, h, w, 1, h, w)`) and the reference image's `h*w` latent rows
(modality video, row-major, coords `(T+2, i, j, 1, h, w, 1, h, w)`), all at time 0 (clean);
their outputs are dropped by `unpack_outputs`. Every table here is a per-row function of the
row's own coordinates, so any shard of the rows computes the same bits as the whole.

Public tensors (`PackedInputs`), as in golden/magi2/*.safetensors `packed.*`:

| name | shape | dtype | meaning |
|---|---|---|---|
| x | [T, Cx] | fp32 | latents / text features, zero-padded to Cx = max in-channels |
| coords | [T, 9] | fp32 | (t, h, w, T, H, W, rT, rH, rW) per token |
| modality | [T] | int64 | 0 video, 1 audio, 2 text |
| cu_seqlens | [S + 1] | int64 | segment boundaries, 0 first, T last |
| time_tokens | [T, 64] | fp32 | sinusoid of the row's diffusion time (0 on text) |
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from headmoe.config import is_number
from headmoe.models.magi2.config import AUDIO, TEXT, VIDEO, Magi2Config

#: audio latents per rotary time unit: an audio run of L tokens spans (L-1)//8 + 1 positions
AUDIO_ROPE_STRIDE = 8


@dataclass(frozen=True)
class BranchInput:
    """One CFG branch: video latents `[T_lat, H_lat, W_lat, video_in_channels]`, audio
    latents `[T_audio, audio_in_channels]`, text features `[L_text, text_in_channels]` (all
    fp32), and the diffusion times tau of video and audio in [0, 1] (1 = pure noise; the
    model sees timestep 1000 * tau)."""

    video: torch.Tensor
    audio: torch.Tensor
    text: torch.Tensor
    t_video: float
    t_audio: float
    image: torch.Tensor | None = None
    """Image-to-video: the reference image's clean latent `[h, w, video_in_channels]` fp32."""
    image_token: torch.Tensor | None = None
    """Image-to-video: the `<Figure 1>` embedding `[text_in_channels]` fp32 (with `image`)."""


#: latent time of the reference image: after the clip's T latents, with a gap of one
IMAGE_TIME_OFFSET = 2


@dataclass(frozen=True)
class BranchOutput:
    """Velocity predictions of one branch, fp32, shaped like the branch's video and audio."""

    video: torch.Tensor
    audio: torch.Tensor


@dataclass(frozen=True)
class PackedInputs:
    """One packed forward's inputs (see the module table for shapes and dtypes)."""

    x: torch.Tensor
    coords: torch.Tensor
    modality: torch.Tensor
    cu_seqlens: torch.Tensor
    time_tokens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def segments(self) -> list[tuple[int, int]]:
        """`(start, stop)` of every segment, on the host."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def validate(self, config: Magi2Config) -> None:
        """Raise `ValueError` naming the first malformed field (before any collective)."""
        t = self.x.shape[0] if isinstance(self.x, torch.Tensor) and self.x.dim() == 2 else -1
        expect = {
            "x": ((t, config.max_in_channels), torch.float32),
            "coords": ((t, 9), torch.float32),
            "modality": ((t,), torch.int64),
            "time_tokens": ((t, config.time_embed_dim), torch.float32),
        }
        for name, (shape, dtype) in expect.items():
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != dtype:
                got = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                raise ValueError(f"packed.{name} must be {dtype} of shape {list(shape)}, got {got}")
        if t < 1:
            raise ValueError("packed.x holds no tokens")
        if self.modality.min() < 0 or self.modality.max() > TEXT:
            raise ValueError("packed.modality values must be 0 (video), 1 (audio) or 2 (text)")
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int64 or \
                cu.numel() < 2 or cu[0] != 0 or cu[-1] != t or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                f"packed.cu_seqlens must be int64 [S+1], 0 first, {t} last, non-decreasing, "
                f"got {cu!r}"
            )


def time_sinusoid(timestep: torch.Tensor, dim: int = 64) -> torch.Tensor:
    """`[cos(t f_k) | sin(t f_k)]`, f_k = exp(-ln(10000) k / (dim/2)), in fp32.

    timestep: `[T]` fp32 in [0, 1000] (1000 tau) -> `[T, dim]` fp32. The fp32 operation
    order is the release's (matches the golden `packed.time_tokens` bit for bit)."""
    half = dim // 2
    k = torch.arange(half, dtype=torch.float32, device=timestep.device)
    freqs = torch.exp(-math.log(10000.0) * k / half)
    arg = timestep.float()[:, None] * freqs
    return torch.cat([arg.cos(), arg.sin()], dim=-1)


def branch_coords(t_lat: int, h_lat: int, w_lat: int, n_audio: int, n_text: int
                  ) -> torch.Tensor:
    """`[T, 9]` fp32 coordinates of one branch's `[video (raster) | audio | text]` rows
    (the module table's `coords`; the refiner uses the same rule)."""
    grid = torch.stack(
        torch.meshgrid(torch.arange(t_lat), torch.arange(h_lat), torch.arange(w_lat),
                       indexing="ij"), dim=-1,
    ).reshape(-1, 3)
    video = torch.cat([grid, torch.tensor([[t_lat, h_lat, w_lat] * 2]).expand(len(grid), 6)], 1)
    audio = torch.zeros(n_audio, 9, dtype=torch.int64)
    audio[:, 0] = torch.arange(n_audio)
    audio[:, 3:] = torch.tensor([n_audio, 1, 1, (n_audio - 1) // AUDIO_ROPE_STRIDE + 1, 1, 1])
    text = torch.zeros(n_text, 9, dtype=torch.int64)
    text[:, 0] = torch.arange(n_text) - n_text
    text[:, 3:] = torch.tensor([n_text, 1, 1, 1, 1, 1])
    return torch.cat([video, audio, text]).float()


def _image_coords(t_lat: int, h_img: int, w_img: int) -> torch.Tensor:
    """`[1 + h*w, 9]` fp32: the special token, then the image grid, at `T + 2`."""
    grid = torch.stack(torch.meshgrid(torch.arange(h_img), torch.arange(w_img), indexing="ij"),
                       dim=-1).reshape(-1, 2)
    rows = torch.cat([torch.tensor([[-1, -1]]), grid])
    size = torch.tensor([[1, h_img, w_img] * 2]).expand(len(rows), 6)
    t = torch.full((len(rows), 1), t_lat + IMAGE_TIME_OFFSET)
    return torch.cat([t, rows, size], 1).float()


def _branch_parts(br: BranchInput) -> list[tuple[int, torch.Tensor, float]]:
    """`(modality, rows [n, C], tau)` of a branch in packing order."""
    parts = [(VIDEO, br.video.reshape(-1, br.video.shape[-1]), br.t_video),
             (AUDIO, br.audio, br.t_audio), (TEXT, br.text, 0.0)]
    if br.image is not None:
        token = cast(torch.Tensor, br.image_token)  # _check_image pairs it with the image
        parts += [(TEXT, token.reshape(1, -1), 0.0),
                  (VIDEO, br.image.reshape(-1, br.image.shape[-1]), 0.0)]
    return parts


def _check_image(b: int, br: BranchInput, config: Magi2Config) -> None:
    if br.image is None and br.image_token is None:
        return
    img, tok = br.image, br.image_token
    ok = (isinstance(img, torch.Tensor) and img.dim() == 3 and img.shape[-1] ==
          config.video_in_channels and img.dtype == torch.float32 and img.shape[:2].numel() > 0
          and isinstance(tok, torch.Tensor) and tuple(tok.shape) == (config.text_in_channels,)
          and tok.dtype == torch.float32)
    if not ok:
        got = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
               for x in (img, tok)]
        raise ValueError(
            f"branches[{b}].image / image_token must be fp32 [h, w, "
            f"{config.video_in_channels}] (h, w >= 1) and [{config.text_in_channels}] "
            f"together, got {got!r}"
        )


def _check_branches(branches: Sequence[BranchInput], config: Magi2Config) -> None:
    if not isinstance(branches, Sequence) or not branches:
        raise ValueError(f"branches must be a non-empty sequence, got {branches!r}")
    for b, br in enumerate(branches):
        if not isinstance(br, BranchInput):
            raise ValueError(f"branches[{b}] must be a BranchInput, got {type(br).__name__}")
        for name, ndim, ch in (("video", 4, config.video_in_channels),
                               ("audio", 2, config.audio_in_channels),
                               ("text", 2, config.text_in_channels)):
            x = getattr(br, name)
            if not isinstance(x, torch.Tensor) or x.dim() != ndim or x.shape[-1] != ch \
                    or x.dtype != torch.float32:
                got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                raise ValueError(
                    f"branches[{b}].{name} must be an fp32 tensor of {ndim} dims with "
                    f"{ch} channels last, got {got!r}"
                )
        for name in ("t_video", "t_audio"):
            t = getattr(br, name)
            if not is_number(t) or not 0.0 <= t <= 1.0:
                raise ValueError(f"branches[{b}].{name} must be a float in [0, 1], got {t!r}")
        _check_image(b, br, config)
    if sum(branch_length(br) for br in branches) == 0:
        raise ValueError("branches hold no tokens (video, audio and text all empty)")


def image_rows(h_img: int, w_img: int) -> int:
    """Rows an `h_img x w_img` reference-image latent adds to a branch: the special token
    and the image grid."""
    return 1 + h_img * w_img


def branch_length(br: BranchInput) -> int:
    """Packed tokens of one branch: video grid + audio + text (+ `image_rows`)."""
    n = br.video.shape[:3].numel() + br.audio.shape[0] + br.text.shape[0]
    return n if br.image is None else n + image_rows(*br.image.shape[:2])


def pack_branches(branches: Sequence[BranchInput], config: Magi2Config) -> PackedInputs:
    """Pack CFG branches (cond first) into one sequence, one segment per branch.

    Raises `ValueError` naming the malformed branch field. All outputs live on the host."""
    _check_branches(branches, config)
    xs, coords, mods, times, cu = [], [], [], [], [0]
    width = config.max_in_channels
    for br in branches:
        t_lat, h_lat, w_lat = br.video.shape[:3]
        for m, part, tau in _branch_parts(br):
            xs.append(torch.nn.functional.pad(part.detach().cpu(), (0, width - part.shape[1])))
            mods.append(torch.full((part.shape[0],), m, dtype=torch.int64))
            times.append(torch.full((part.shape[0],), float(1000.0 * tau), dtype=torch.float32))
        coords.append(branch_coords(t_lat, h_lat, w_lat, br.audio.shape[0], br.text.shape[0]))
        if br.image is not None:
            coords.append(_image_coords(t_lat, *br.image.shape[:2]))
        cu.append(cu[-1] + branch_length(br))
    return PackedInputs(
        x=torch.cat(xs), coords=torch.cat(coords), modality=torch.cat(mods),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64),
        time_tokens=time_sinusoid(torch.cat(times), config.time_embed_dim),
    )


def unpack_outputs(
    out: torch.Tensor, branches: Sequence[BranchInput], config: Magi2Config
) -> list[BranchOutput]:
    """`[T, out_width]` packed predictions -> one `BranchOutput` per branch (video
    `[T_lat, H_lat, W_lat, C_video]`, audio `[T_audio, C_audio]`, fp32, contiguous)."""
    outs, start = [], 0
    for br in branches:
        nv, na = br.video.shape[:3].numel(), br.audio.shape[0]
        video = out[start : start + nv, : config.video_in_channels].reshape(br.video.shape)
        audio = out[start + nv : start + nv + na, : config.audio_in_channels]
        outs.append(BranchOutput(video.contiguous(), audio.contiguous()))
        start += branch_length(br)
    return outs


def modality_order(modality: torch.Tensor) -> torch.Tensor:
    """`[T]` int64: the stable sort of the rows by modality (row r of a modality-grouped
    tensor is sequence row `order[r]`; golden `packed.modality_order`)."""
    return torch.sort(modality, stable=True).indices
