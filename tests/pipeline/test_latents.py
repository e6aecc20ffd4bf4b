"""The video latent geometry: ``4k+1`` frames, sides of 16, latent shapes and frame counts."""

from __future__ import annotations

import pytest

from headmoe.pipeline.latents import frame_count, latent_shape


def test_latent_shape():
    assert latent_shape(125, 720, 1280) == (32, 45, 80)
    assert [latent_shape(n, 16, 16)[0] for n in (1, 5, 9, 13)] == [1, 2, 3, 4]
    for n in (2, 6, 14):  # the decoders make 1 + 4k frames: others are refused
        with pytest.raises(ValueError, match=rf"num_frames={n} must be of the form 4k\+1"):
            latent_shape(n, 16, 16)
    assert frame_count(32) == 125
    with pytest.raises(ValueError, match="height=20 must be a positive multiple of 16, e.g. 16"):
        latent_shape(5, 20, 16)
    with pytest.raises(ValueError, match="num_frames"):
        latent_shape(0, 16, 16)
