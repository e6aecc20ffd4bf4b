"""Presets, validation against a ParallelConfig, parameter names and the meta-device count."""

import dataclasses

import pytest
import torch

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext, plan_topology
from headmoe.models.magi2 import Magi2Transformer, get_config, validate_parallel

# MAGI-2 Preview's checkpoint tensors, all elements (see docs/model.md); the router biases
# (36 layers x 2 x 3072) are buffers, the rest parameters
PREVIEW_PARAMS = 113_582_952_496
ROUTER_BIASES = 36 * 2 * 3072


def test_presets_and_layer_ids():
    p = get_config("magi2-preview")
    assert (p.num_layers, p.hidden_size, p.num_attention_heads, p.head_dim) == (40, 3072, 24, 128)
    assert p.dense_layer_ids == (0, 1, 38, 39) and p.moe_layer_ids == tuple(range(2, 38))
    assert (p.moe_num_heads, p.moe_head_dim, p.moe_num_experts, p.moe_top_k) == (12, 256, 256, 6)
    t = get_config("tiny")
    assert t.dense_layer_ids == (0, 1, 4, 5) and t.moe_layer_ids == (2, 3)
    assert (t.hidden_size, t.head_dim, t.moe_num_heads, t.moe_head_dim) == (384, 16, 12, 32)
    assert Magi2Transformer.expert_parallel_style == "head"
    assert get_config("tiny", num_layers=3, dense_layers=(0,)).moe_layer_ids == (1, 2)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"dense_layers": (0, 6)}, "dense_layers"), ({"moe_top_k": 9}, "moe_top_k"),
     ({"rope_bands": 3}, "rope_bands"), ({"hidden_size": 0}, "hidden_size"),
     ({"time_embed_dim": 63}, "time_embed_dim")],
)
def test_bad_config_names_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        get_config("tiny", **overrides)
    with pytest.raises(ValueError, match="model config name"):
        get_config("huge")


@pytest.mark.parametrize(
    ("parallel", "words"),
    [(ParallelConfig(ulysses_degree=5), ["num_attention_heads=24", "ulysses_degree=5"]),
     (ParallelConfig(ulysses_degree=2, tensor_parallel_size=2), ["tensor_parallel_size=2"]),
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


def _expected_names(i: int, moe: bool) -> set[str]:
    """MAGI2.md section 5, written out by hand."""
    p = f"block.layers.{i}."
    names = {p + f"attention.{n}.weight" for n in
             ("pre_norm", "linear_g", "linear_qkv", "linear_proj", "q_norm", "k_norm")}
    names |= {p + "attention.sinks", p + "mhc_norm.weight"}
    for b in ("attn", "mlp"):
        names |= {p + f"mhc_{a}_{k}_{b}" for a in ("alpha", "bias") for k in ("pre", "post", "res")}
        names.add(p + f"mhc_phi_fused_{b}")
    if moe:
        names |= {p + f"mlp.moe_mlp.{n}" for n in ("gate", "W_gate", "W_up", "W_down",
                                                   "router.expert_bias", "router.expert_bias_ema")}
        names |= {p + f"mlp.{n}.weight" for n in (
            "pre_norm", "split_linear", "merge_linear", "shared_expert_fc1", "shared_expert_fc2",
            "modality_specific_shared_expert_fc1", "modality_specific_shared_expert_fc2")}
    else:
        names |= {p + f"mlp.{n}.weight" for n in ("pre_norm", "up_gate_proj", "down_proj")}
    return names


def _preview_param_count() -> int:
    """From MAGI2.md section 1 numbers, independently of the model code."""
    c, heads, d, n = 3072, 24, 128, 4
    attn = c + heads * c + 3 * heads * d * c + heads * d * c + 2 * d + heads
    mhc = 2 * (3 + n + n + n * n + n * c * (2 * n + n * n)) + n * c
    dense = 3 * c + 3 * 2 * 8192 * c + 3 * c * 8192
    experts = 12 * 256
    moe = (3 * c + 2 * 3072 * c + 3 * 1280 * c + 3 * 3 * 1280 * c
           + experts * 256 + 3 * experts * 256 * 1280 + 2 * experts)
    adapters = (48 + 64 + 5120) * c + 3 * c + 2 * c + (48 + 64) * c
    return 40 * (attn + mhc) + 4 * dense + 36 * moe + adapters


def test_preview_builds_on_meta_with_exact_count_and_names():
    cfg = get_config("magi2-preview")
    with torch.device("meta"):
        model = Magi2Transformer(cfg, dtype=torch.bfloat16)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    sd = model.state_dict()
    assert sum(v.numel() for v in sd.values()) == _preview_param_count() == PREVIEW_PARAMS
    assert sum(p.numel() for p in params) == PREVIEW_PARAMS - ROUTER_BIASES
    for i in (1, 2):
        assert {k for k in sd if k.startswith(f"block.layers.{i}.")} == _expected_names(i, i == 2)
    assert sd["block.layers.2.mlp.moe_mlp.W_up"].shape == (3072, 256, 1280)
    assert sd["block.layers.2.mlp.moe_mlp.W_down"].shape == (3072, 1280, 256)
    assert sd["block.layers.2.mlp.moe_mlp.gate"].dtype == torch.float32
    assert sd["block.layers.2.mlp.moe_mlp.W_gate"].dtype == torch.bfloat16
    assert sd["block.layers.0.attention.sinks"].shape == (1, 24)
    assert sd["block.layers.0.mlp.up_gate_proj.weight"].shape == (3 * 2 * 8192, 3072)
    assert sd["block.layers.0.mhc_phi_fused_attn"].dtype == torch.float32
    assert {k for k in sd if "adapter" in k} == {
        f"pre_adapter.{m}_embedder.{w}" for m in ("video", "audio", "text")
        for w in ("weight", "bias")
    } | {f"post_adapter.final_{k}_{m}.weight" for k in ("norm", "linear")
         for m in ("video", "audio")}
    assert dataclasses.asdict(cfg) == cfg.to_dict()
