"""Media output: an mp4 (H.264 video + AAC audio, PyAV) and its JSON sidecar, both written
atomically (`headmoe.files.atomic_write`).

The sidecar's `video_sha256` / `audio_sha256` hash the decoded uint8 frames and the int16
audio samples handed to the encoders, not the container bytes (which carry encoder
metadata and lossy codec output).
"""

from __future__ import annotations

import hashlib
import json
from fractions import Fraction
from pathlib import Path
from typing import cast

import av
import numpy as np
import torch

from headmoe.files import atomic_write


def quantize_audio(wave: torch.Tensor) -> torch.Tensor:
    """``[channels, samples]`` float in [-1, 1] -> int16 (round to nearest, clamped)."""
    return (wave.to(torch.float32) * 32767.0).round().clamp(-32768, 32767).to(torch.int16)


def tensor_sha256(x: torch.Tensor) -> str:
    """sha256 hex digest of a tensor's contiguous bytes (shape and dtype not included)."""
    return hashlib.sha256(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def sidecar_path(output: str | Path) -> Path:
    """The JSON sidecar next to ``output``: the same path with its suffix replaced by .json."""
    return Path(output).with_suffix(".json")


def write_mp4(
    path: str | Path,
    frames: torch.Tensor,
    fps: float,
    audio: torch.Tensor,
    sample_rate: int,
    *,
    overwrite: bool = True,
) -> None:
    """Write ``frames`` ``[F, H, W, 3]`` uint8 (H, W even) at ``fps`` and ``audio``
    ``[channels, samples]`` int16 (1 or 2 channels) at ``sample_rate`` to an mp4 with H.264
    (yuv420p) video and AAC audio, atomically (`headmoe.files.atomic_write`; without
    ``overwrite`` an existing file is never replaced)."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}"
        )
    if audio.dtype != torch.int16 or audio.dim() != 2 or audio.shape[0] not in (1, 2):
        raise ValueError(f"audio must be int16 [1|2, S], got {audio.dtype} {tuple(audio.shape)}")
    rate = Fraction(fps).limit_denominator(1001)
    video_np = frames.cpu().numpy()
    audio_np = audio.cpu().numpy().astype(np.float32) / 32768.0
    layout = "mono" if audio.shape[0] == 1 else "stereo"

    def write(tmp: str) -> None:
        with av.open(tmp, mode="w", format="mp4") as container:
            vs = container.add_stream("libx264", rate=rate)
            vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            as_ = container.add_stream("aac", rate=sample_rate, layout=layout)
            for img in video_np:
                frame = av.VideoFrame.from_ndarray(img, format="rgb24")
                container.mux(vs.encode(frame))
            container.mux(vs.encode())
            chunk = 1024
            for start in range(0, audio_np.shape[1], chunk):
                af = av.AudioFrame.from_ndarray(
                    np.ascontiguousarray(audio_np[:, start : start + chunk]),
                    format="fltp",
                    layout=layout,
                )
                af.sample_rate, af.pts = sample_rate, start
                container.mux(as_.encode(af))
            container.mux(as_.encode())

    atomic_write(path, write, overwrite=overwrite)


def write_sidecar(path: str | Path, data: dict[str, object], *, overwrite: bool = True) -> None:
    """Write ``data`` as indented JSON to ``path``, atomically (see `write_mp4`)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")

    atomic_write(path, write, overwrite=overwrite)


def read_mp4(path: str | Path) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Decode an mp4: (frames ``[F, H, W, 3]`` uint8, audio ``[channels, samples]`` float32,
    video fps, audio sample rate). For checks and tests."""
    with av.open(str(path)) as container:
        vs, as_ = container.streams.video[0], container.streams.audio[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(vs)]
        fps = float(cast(Fraction, vs.average_rate))  # a written mp4's video stream has one
        container.seek(0)
        chunks = [f.to_ndarray() for f in container.decode(as_)]
        rate = as_.rate
    audio = np.concatenate(chunks, axis=1) if chunks else np.zeros((1, 0), np.float32)
    return np.stack(frames), audio.astype(np.float32), fps, rate
