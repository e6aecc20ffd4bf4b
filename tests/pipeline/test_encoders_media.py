"""Tiny encoders/decoders and media output."""

import hashlib
import json

import pytest
import torch

from headmoe.pipeline.media import (
    quantize_audio,
    read_mp4,
    sidecar_path,
    tensor_sha256,
    write_mp4,
    write_sidecar,
)
from headmoe.release.standins import ByteTextEncoder, TinyAudioDecoder, TinyVideoDecoder


def test_byte_tokenizer_and_embedding():
    enc = ByteTextEncoder(8, max_tokens=5)
    assert enc.tokenize("") == [256]
    assert enc.tokenize("hé") == [256, 104, 0xC3, 0xA9]
    assert enc.tokenize("abcdefg") == [256, 97, 98, 99, 100]
    feats = enc.encode("hé")
    assert feats.shape == (4, 8) and feats.dtype == torch.float32
    assert torch.equal(feats[1], enc.table[104])
    assert torch.equal(ByteTextEncoder(8).table, enc.table)  # fixed seed


def test_video_decoder_shapes_and_layout():
    dec = TinyVideoDecoder(3)
    assert dec.latent_shape(13, 64, 96) == (4, 4, 6)
    assert dec.latent_shape(1, 16, 16) == (1, 1, 1)
    with pytest.raises(ValueError, match="width=40 must be a positive multiple of 16, e.g. 32"):
        dec.latent_shape(5, 32, 40)
    with pytest.raises(ValueError, match=r"num_frames=14 must be of the form 4k\+1"):
        dec.latent_shape(14, 32, 32)  # the release decoders' rule (serve once took 14)
    lat = torch.randn(4, 4, 6, 3, generator=torch.Generator().manual_seed(0))
    frames = dec.decode(lat, 13)
    assert frames.shape == (13, 64, 96, 3) and frames.dtype == torch.uint8
    # Output frame 4k + j - 3, row 16a + b, col 16c + d is entry (j, b, d) of latent token
    # (k, a, c)'s block; frame 0 is the last frame of the first latent's block.
    px = torch.tanh(lat[2, 1, 5] @ dec.weight).reshape(4, 16, 16, 3)
    expect = ((px[1, 3, 7] + 1) * 127.5).round().to(torch.uint8)
    assert torch.equal(frames[4 * 2 + 1 - 3, 16 + 3, 16 * 5 + 7], expect)
    px0 = torch.tanh(lat[0, 0, 0] @ dec.weight).reshape(4, 16, 16, 3)
    assert torch.equal(frames[0, 2, 9], ((px0[3, 2, 9] + 1) * 127.5).round().to(torch.uint8))


def test_audio_decoder():
    dec = TinyAudioDecoder(4)
    assert dec.latent_length(13 / 12.5) == 26 and dec.latent_length(1.0) == 25
    lat = torch.randn(26, 4, generator=torch.Generator().manual_seed(1))
    wave = dec.decode(lat, 45864)
    assert wave.shape == (1, 45864)
    assert torch.equal(wave[0, 1764 * 3 + 10], torch.tanh(lat[3] @ dec.weight[:, 10]))
    q = quantize_audio(torch.tensor([[1.0, -1.0, 0.5, 2.0]]))
    assert q.tolist() == [[32767, -32767, 16384, 32767]]


def test_mp4_round_trip_and_sidecar(tmp_path):
    gen = torch.Generator().manual_seed(3)
    frames = torch.randint(0, 256, (13, 64, 96, 3), generator=gen, dtype=torch.uint8)
    audio = quantize_audio(torch.rand(1, 45864, generator=gen) * 2 - 1)
    out = tmp_path / "sub" / "clip.mp4"
    write_mp4(out, frames, 12.5, audio, 44100)
    assert sorted(p.name for p in out.parent.iterdir()) == ["clip.mp4"]  # no temp file left
    video, wave, fps, rate = read_mp4(out)
    assert video.shape == (13, 64, 96, 3) and fps == 12.5 and rate == 44100
    assert abs(wave.shape[1] - 45864) <= 2048  # AAC frames are 1024 samples
    side = sidecar_path(out)
    assert side == tmp_path / "sub" / "clip.json"
    write_sidecar(side, {"a": 1})
    assert json.loads(side.read_text()) == {"a": 1}
    assert tensor_sha256(frames) == hashlib.sha256(frames.numpy().tobytes()).hexdigest()


def test_failed_write_leaves_nothing(tmp_path):
    frames = torch.zeros(2, 16, 16, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="audio must be int16"):
        write_mp4(tmp_path / "x.mp4", frames, 10, torch.zeros(1, 100), 44100)
    with pytest.raises(TypeError):
        write_sidecar(tmp_path / "x.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []
