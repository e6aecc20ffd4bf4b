"""The refiner's strict loader: released names only, every problem named before a tensor
is read; sharded index files; the bf16 release loaded into an fp32 model is reported."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from headmoe.models.refiner import (
    Magi2Refiner,
    check_refiner_checkpoint,
    get_refiner_config,
    load_refiner,
    refiner_spec,
    write_random_refiner,
)
from tests.models.refiner_golden import golden_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = get_refiner_config("tiny-refiner")
    path = tmp_path_factory.mktemp("refiner") / "model.safetensors"
    write_random_refiner(cfg, path, seed=3)
    return cfg, path


def _rewrite(src, dst, edit):
    tensors = load_file(src)
    edit(tensors)
    save_file(tensors, dst)
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.pop("block.layers.1.mlp.down_proj.weight"),
     ["1 missing tensors", "block.layers.1.mlp.down_proj.weight"]),
    (lambda t: t.update({"block.layers.0.attention.sinks": torch.zeros(8)}),
     ["1 unexpected tensors", "block.layers.0.attention.sinks"]),
    (lambda t: t.update({"block.layers.2.attention.q_norm.weight": torch.zeros(48)}),
     ["mis-shaped", "block.layers.2.attention.q_norm.weight expected [16] F32, found [48]"]),
    (lambda t: t.update({"pre_adapter.rope.bands": torch.zeros(2, dtype=torch.int32)}),
     ["non-float", "pre_adapter.rope.bands"]),
])
def test_refused_checkpoints_name_the_tensor(tiny, tmp_path, edit, words):
    cfg, path = tiny
    bad = _rewrite(path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(ValueError) as err:
        check_refiner_checkpoint(cfg, bad)
    for w in words:
        assert w in str(err.value)


def test_sharded_index_and_prefix_load_the_same_values(tiny, tmp_path):
    cfg, path = tiny
    index = tmp_path / "refiner.safetensors.index.json"
    write_random_refiner(cfg, index, seed=3, max_shard_bytes=64 << 10)
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1
    prefixed = _rewrite(path, tmp_path / "p.safetensors", lambda t: t.update(
        {f"transformer.{k}": t.pop(k) for k in list(t)}))
    states = []
    for p in (path, index, prefixed):
        m = Magi2Refiner(cfg, dtype=torch.bfloat16)
        load_refiner(m, p)
        states.append(m.state_dict())
    for s in states[1:]:
        assert all(torch.equal(s[k], states[0][k]) for k in states[0])
    assert list(states[0]) == list(refiner_spec(cfg))


def test_bf16_linears_into_fp32_model_are_reported():
    from tests.goldens import golden_file

    m = Magi2Refiner(golden_config(), dtype=torch.float32)
    report = load_refiner(m, golden_file("magi2_refiner", "model.safetensors"))
    assert len(report.converted) == 6 * 5
    assert all(stored == "BF16" and to == "F32" for _, stored, to in report.converted)


def test_bad_config_fields_are_named():
    with pytest.raises(ValueError, match="num_query_groups"):
        get_refiner_config("tiny-refiner", num_query_groups=3)
    with pytest.raises(ValueError, match="activation_type"):
        type(golden_config()).from_dict({"mm_layers": [0], "num_layers": 1, "hidden_size": 64,
                                         "head_dim": 16, "num_query_groups": 2,
                                         "activation_type": "gelu"})
