"""Presets, the public config schema, validation against a ParallelConfig, and the released
tensor list of MAGI-2 Preview on the meta device."""

import json

import pytest
import torch

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext, plan_topology
from headmoe.models.magi2 import (
    Magi2Config,
    Magi2Transformer,
    checkpoint_spec,
    get_config,
    parameter_count,
    validate_parallel,
)
from tests.goldens import ROOT as GOLDEN_ROOT

GOLDEN = GOLDEN_ROOT / "magi2"
#: every value of MAGI-2 Preview's released transformer (MAGI2.md section 1)
PREVIEW_PARAMS = 113_934_953_536


def _preview_param_count() -> int:
    """From MAGI2.md section 1 numbers, independently of the model code."""
    c, d, n, hq, hkv = 3072, 128, 4, 24, 24
    v = n * c
    mhc = 2 * (3 + n + n + n * n + v * (2 * n + n * n))

    def attn(sets):
        return sets * (c + hq * c + (hq + 2 * hkv) * d * c + c * hq * d + 2 * d) + hq

    dense = 3 * (c + 2 * 8192 * c + c * 8192)
    rows = 12 * 256
    moe = (3 * c + 2 * c * c + rows * 256 + 3 * rows * 256 * 1280 + 2 * rows
           + 3 * 1280 * c + 3 * 3 * 1280 * c)
    adapters = (48 + 64 + 5120) * v + 3 * v + 16 + 2 * v + (48 + 64) * v
    return 4 * (mhc + 3 * v + attn(3) + dense) + 36 * (mhc + v + attn(1) + moe) + adapters


def _released_tensors() -> dict:
    rows = (GOLDEN / "preview_tensors.tsv").read_text().splitlines()
    assert rows[0] == "name\tshape\tdtype"
    return {n: (tuple(json.loads(s)), d) for n, s, d in (r.split("\t") for r in rows[1:])}


def test_presets_and_layer_ids():
    p = get_config("magi2-preview")
    assert (p.num_layers, p.hidden_size, p.num_attention_heads, p.head_dim) == (40, 3072, 24, 128)
    assert p.dense_layer_ids == (0, 1, 38, 39) and p.moe_layer_ids == tuple(range(2, 38))
    assert (p.moe_num_heads, p.moe_head_dim, p.moe_num_experts, p.moe_top_k) == (12, 256, 256, 6)
    assert (p.dense_intermediate_size, p.mhc_width, p.rope_bands) == (8192, 12288, 16)
    t = get_config("tiny")
    assert t.dense_layer_ids == (0, 1, 4, 5) and t.moe_layer_ids == (2, 3)
    assert (t.hidden_size, t.head_dim, t.moe_num_heads, t.moe_head_dim) == (384, 16, 12, 32)
    assert get_config("tiny", num_layers=3, multimodal_layers=(0,)).moe_layer_ids == (1, 2)


def test_preview_on_meta_lists_the_released_tensors():
    cfg = get_config("magi2-preview")
    spec = checkpoint_spec(cfg)
    released = _released_tensors()
    assert len(released) == 1371
    mine = {k: (s, str(d).removeprefix("torch.")) for k, (s, d) in spec.items()}
    assert mine == released
    assert list(mine) == list(released)  # also the released order
    assert parameter_count(cfg) == _preview_param_count() == PREVIEW_PARAMS
    with torch.device("meta"):
        model = Magi2Transformer(cfg, dtype=torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())


def test_golden_config_json_reads_into_the_golden_model():
    cfg = Magi2Config.from_json(GOLDEN / "config.json")
    assert (cfg.num_layers, cfg.multimodal_layers, cfg.moe_layer_ids) == (4, (0, 3), (1, 2))
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_query_groups, cfg.text_in_channels) == (
        192, 16, 12, 40)
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.params_dtype) == (8, 2, "float32")
    assert cfg.dense_intermediate_size == 512
    # round trip through our own dict form
    assert Magi2Config.from_dict(cfg.to_dict(), name=cfg.name) == cfg


@pytest.mark.parametrize(
    ("edit", "field"),
    [(lambda d: d.update(rope_scale=2), "unknown fields: rope_scale"),
     (lambda d: d["moe"].update(foo=1), "unknown fields: moe.foo"),
     (lambda d: d.update(attention_softcap=30.0), "attention_softcap=30.0"),
     (lambda d: d["moe"].update(score_function="softmax"), "moe.score_function"),
     (lambda d: d["moe"].update(layers=[1]), "moe.layers"),
     (lambda d: d.pop("head_dim"), "missing fields for: head_dim"),
     (lambda d: d.update(head_dim=20), "head_dim"),
     (lambda d: d.update(num_query_groups=5), "num_query_groups=5"),
     (lambda d: d.update(params_dtype="int8"), "params_dtype"),
     (lambda d: d.update(multimodal_layers=[0, 9]), "multimodal_layers")],
)
def test_public_schema_errors_name_the_field(edit, field, tmp_path):
    data = json.loads((GOLDEN / "config.json").read_text())
    edit(data)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field) as err:
        Magi2Config.from_json(path)
    assert str(path) in str(err.value)


def test_unreadable_config_file_is_named(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not a readable JSON"):
        Magi2Config.from_json(path)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"multimodal_layers": (0, 6)}, "multimodal_layers"), ({"moe_top_k": 9}, "moe_top_k"),
     ({"hidden_size": 0}, "hidden_size"), ({"time_embed_dim": 63}, "time_embed_dim")],
)
def test_bad_config_names_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        get_config("tiny", **overrides)
    with pytest.raises(ValueError, match="model config name"):
        get_config("huge")


@pytest.mark.parametrize(
    ("parallel", "words"),
    [(ParallelConfig(ulysses_degree=5), ["num_attention_heads=24", "ulysses_degree=5"]),
     (ParallelConfig(ulysses_degree=2, cfg_parallel_size=3), ["cfg_parallel_size=3"])],
)
def test_parallel_validation(parallel, words):
    with pytest.raises(ValueError) as err:
        validate_parallel(get_config("tiny"), parallel)
    for w in words:
        assert w in str(err.value)
    # the transformer validates its context on construction (no process group needed)
    ctx = ParallelContext(topology=plan_topology(parallel.world_size, parallel), rank=0)
    with pytest.raises(ValueError, match=words[0]):
        Magi2Transformer(get_config("tiny"), ctx)
