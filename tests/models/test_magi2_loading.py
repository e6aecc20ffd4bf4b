"""Checkpoint checks of the released layout: the `transformer.` prefix, old (look-alike)
layouts, dtypes, and index files whose shards must stay inside the index's folder."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from headmoe.models.magi2 import Magi2Transformer, check_checkpoint, load_checkpoint
from tests.models.common import SMALL


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    from headmoe.models.magi2 import write_random_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    write_random_checkpoint(SMALL, path, seed=7)
    return load_file(path)


def _save(tmp_path, name, tensors):
    path = tmp_path / name
    save_file(tensors, path)
    return path


def test_prefixed_names_load_like_bare_ones(tmp_path, full):
    bare = Magi2Transformer(SMALL)
    load_checkpoint(bare, _save(tmp_path, "bare.safetensors", full))
    pre = Magi2Transformer(SMALL)
    report = load_checkpoint(pre, _save(tmp_path, "pre.safetensors",
                                        {f"transformer.{k}": v for k, v in full.items()}))
    assert report.prefix == "transformer."
    for k, v in bare.state_dict().items():
        assert torch.equal(v, pre.state_dict()[k]), k


def test_mixed_prefixes_are_refused(tmp_path, full):
    mixed = {(f"transformer.{k}" if i % 2 else k): v for i, (k, v) in enumerate(full.items())}
    with pytest.raises(ValueError, match="mixes names with and without"):
        load_checkpoint(Magi2Transformer(SMALL), _save(tmp_path, "mixed.safetensors", mixed))


def test_old_lookalike_layout_is_refused_naming_tensors(tmp_path, full):
    """The look-alike of earlier headmoe: C-wide adapters, [n*n] res biases, shared attention
    weights in multimodal layers, no rope bands."""
    c, n = SMALL.hidden_size, SMALL.mhc_streams
    old = {k: v for k, v in full.items() if k != "pre_adapter.rope.bands"}
    old["pre_adapter.video_embedder.weight"] = torch.zeros(c, SMALL.video_in_channels)
    old["block.layers.0.mhc_bias_res_attn"] = torch.zeros(n * n)
    old["block.layers.0.attention.linear_g.weight"] = torch.zeros(
        SMALL.num_attention_heads, c, dtype=torch.bfloat16)
    path = _save(tmp_path, "old.safetensors", old)
    with pytest.raises(ValueError) as err:
        load_checkpoint(Magi2Transformer(SMALL), path)
    msg = str(err.value)
    assert "missing tensors: pre_adapter.rope.bands" in msg
    assert "3 mis-shaped tensors" in msg
    assert f"pre_adapter.video_embedder.weight expected [{4 * c}, 48] F32, found [{c}, 48]" in msg
    assert "block.layers.0.mhc_bias_res_attn expected [4, 4] F32, found [16] F32" in msg
    assert "block.layers.0.attention.linear_g.weight" in msg


def test_dtypes_float_converted_and_reported_integer_refused(tmp_path, full):
    name = "block.layers.0.attention.linear_qkv.weight"
    halves = {**full, name: full[name].to(torch.float16)}
    model = Magi2Transformer(SMALL, dtype=torch.bfloat16)
    report = load_checkpoint(model, _save(tmp_path, "f16.safetensors", halves))
    assert report.converted == [(name, "F16", "BF16")]
    assert torch.equal(model.state_dict()[name], full[name].to(torch.float16).bfloat16())
    fp32_model = Magi2Transformer(SMALL, dtype=torch.float32)
    report = load_checkpoint(fp32_model, _save(tmp_path, "f32.safetensors", full))
    assert (name, "BF16", "F32") in report.converted  # the model's dtype, said so
    for bad in (torch.int32, torch.bool):
        ints = {**full, "block.layers.1.attention.sinks": torch.zeros(1, 24, dtype=bad)}
        with pytest.raises(ValueError, match="non-float dtype: block.layers.1.attention.sinks"):
            check_checkpoint(SMALL, _save(tmp_path, f"{bad}.safetensors".replace("torch.", ""),
                                          ints))


def _index(folder, weight_map):
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_index_shards_must_stay_inside_the_folder(tmp_path, full):
    inner = tmp_path / "ckpt"
    inner.mkdir()
    save_file(full, tmp_path / "other.safetensors")
    save_file(full, inner / "shard.safetensors")
    os.symlink(tmp_path / "other.safetensors", inner / "link.safetensors")
    names = list(full)
    for shard in ("../other.safetensors", str(tmp_path / "other.safetensors"),
                  "link.safetensors", "../../etc/passwd"):
        with pytest.raises(ValueError, match="outside the folder|not a relative file name"):
            check_checkpoint(SMALL, _index(inner, dict.fromkeys(names, shard)))
    with pytest.raises(ValueError, match="shard file .*missing.safetensors.* is missing"):
        check_checkpoint(SMALL, _index(inner, dict.fromkeys(names, "missing.safetensors")))
    bad = inner / "model.safetensors.index.json"
    for text in ("{not json", json.dumps({"weight_map": {"a": 3}})):
        bad.write_text(text)
        with pytest.raises(ValueError, match="model.safetensors.index.json"):
            check_checkpoint(SMALL, bad)
    ok = _index(inner, dict.fromkeys(names, "shard.safetensors"))
    load_checkpoint(Magi2Transformer(SMALL), ok)


def test_truncated_file_is_named(tmp_path, full):
    path = _save(tmp_path, "whole.safetensors", full)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.safetensors"):
        load_checkpoint(Magi2Transformer(SMALL), cut)
