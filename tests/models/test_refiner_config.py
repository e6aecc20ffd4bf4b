"""The refiner's configuration in SandAI's nested form (``arch`` / ``data_proxy`` /
``evaluation``, as golden/magi2_refiner/config.json): read, its data-proxy and evaluation
fields checked against the released refiner's, a differing or unknown one refused by name;
a release folder whose ``refiner/config.json`` has that form loads (issue 26 point 4)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from headmoe.models.refiner import get_refiner_config
from headmoe.models.refiner.config import RELEASED_EVALUATION, Magi2RefinerConfig
from headmoe.pipeline import refine
from headmoe.release import folder as release
from tests.goldens import golden_file

NESTED = json.loads(golden_file("magi2_refiner", "config.json").read_text())


def test_golden_nested_config_is_read():
    cfg = Magi2RefinerConfig.from_json(golden_file("magi2_refiner", "config.json"))
    arch = NESTED["arch"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim) == (
        arch["num_layers"], arch["hidden_size"], arch["head_dim"])
    assert cfg.multimodal_layers == tuple(arch["mm_layers"])
    assert cfg.num_attention_heads == arch["num_heads_q"] and cfg.params_dtype == "bfloat16"
    assert cfg.block_size == (8, 4, 4) and cfg.radius == (2, 2, 2)


def test_released_evaluation_has_one_home():
    ev = NESTED["evaluation"]
    for key, value in RELEASED_EVALUATION.items():
        assert ev[key] == value, key
    assert (refine.REFINER_STEPS, refine.REFINER_SHIFT, refine.REFINER_GUIDANCE,
            refine.REFINER_NOISE_INDEX) == (5, 5.0, 2.0, 220)


@pytest.mark.parametrize("path, value, message", [
    ("data_proxy.attn_config.block_t_size", 16,
     "data_proxy.attn_config.block_t_size=16 differs from the released refiner's 8"),
    ("data_proxy.attn_config.window.block_w_radius", 1,
     "data_proxy.attn_config.window.block_w_radius=1 differs from the released refiner's 2"),
    ("data_proxy.attn_config.window.full_attn_layers", [0],
     "data_proxy.attn_config.window.full_attn_layers=[0] differs"),
    ("evaluation.magi2_refiner_num_inference_steps", 8,
     "evaluation.magi2_refiner_num_inference_steps=8 differs from the released refiner's 5"),
    ("evaluation.magi2_refiner_shift", 3.0, "evaluation.magi2_refiner_shift=3.0 differs"),
    ("evaluation.magi2_refiner_video_txt_guidance_scale", 4.0,
     "evaluation.magi2_refiner_video_txt_guidance_scale=4.0 differs"),
    ("evaluation.magi2_refiner_noise_value", 300,
     "evaluation.magi2_refiner_noise_value=300 differs"),
    ("data_proxy.attn_config.window.bogus", 1,
     "unknown field data_proxy.attn_config.window.bogus"),
    ("evaluation", [], "field evaluation must be a JSON object, got list"),
    ("extra", {}, "unknown fields: extra"),
])
def test_differing_fields_are_refused_by_name(path, value, message):
    data = copy.deepcopy(NESTED)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    with pytest.raises(ValueError, match="refiner config") as err:
        Magi2RefinerConfig.from_dict(data)
    assert message in str(err.value)


def test_unused_fields_are_read_not_refused():
    data = copy.deepcopy(NESTED)
    data["evaluation"]["shift"] = 9.0  # the preview's recipe, not the refiner's
    data["data_proxy"]["attn_config"]["window"]["win_size"] = 512
    assert Magi2RefinerConfig.from_dict(data).num_layers == NESTED["arch"]["num_layers"]


def test_release_folder_with_a_nested_refiner_config(tmp_path_factory, tmp_path,
                                                     tiny_release_in):
    folder = tiny_release_in(tmp_path_factory.mktemp("cache"))
    copy_dir = tmp_path / "release"
    shutil.copytree(folder, copy_dir, symlinks=True)
    tiny = get_refiner_config("tiny-refiner")
    arch = {"num_layers": tiny.num_layers, "hidden_size": tiny.hidden_size,
            "head_dim": tiny.head_dim, "num_query_groups": tiny.num_query_groups,
            "text_in_channels": tiny.text_in_channels,
            "mm_layers": list(tiny.multimodal_layers), "params_dtype": "torch.bfloat16"}
    nested = {"arch": arch, "data_proxy": NESTED["data_proxy"],
              "evaluation": NESTED["evaluation"]}
    cfg_file = copy_dir / "refiner" / "config.json"
    cfg_file.unlink(missing_ok=True)
    cfg_file.write_text(json.dumps(nested))
    _, cfg = release.find_refiner(copy_dir)
    assert {k: v for k, v in cfg.to_dict().items() if k != "name"} == {
        k: v for k, v in tiny.to_dict().items() if k != "name"}
