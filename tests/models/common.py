"""Shared request builders for the MAGI-2 model tests."""

from __future__ import annotations

import torch

from headmoe.models.magi2 import BranchInput, Magi2Config, get_config


def make_request(
    config: Magi2Config, seed: int, grid: tuple[int, int, int], audio: int,
    texts: tuple[int, ...],
) -> list[BranchInput]:
    """One branch per text length (cond first); branches share video/audio shapes and times
    but have their own noise, as CFG branches differ only in text in practice."""
    g = torch.Generator().manual_seed(seed)
    return [
        BranchInput(
            video=torch.randn(*grid, config.video_in_channels, generator=g),
            audio=torch.randn(audio, config.audio_in_channels, generator=g),
            text=torch.randn(n, config.text_in_channels, generator=g),
            t_video=0.8, t_audio=0.35,
        )
        for n in texts
    ]


#: test-only smaller variant (dense 0, MoE 1 and 2) for checks that build many models
SMALL = get_config("tiny", num_layers=3, multimodal_layers=(0,), text_in_channels=64,
                   intermediate_factor=0.5)
