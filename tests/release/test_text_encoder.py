"""Qwen3.5 text encoder: tiny random model + offline tokenizer folder, feature = hidden_states[-3]."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from headmoe.pipeline.prompts import RELEASED_SPLIT_PATTERN, normalize_prompt
from headmoe.pipeline.released import MAX_TEXT_TOKENS
from headmoe.release import text_encoder as te
from headmoe.release.tiny_text_encoder import TINY_CORPUS, build_tiny_text_encoder

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

PROMPTS = ["A red fox runs across a snowy field", "Waves", "Zwei Kinder lachen; 山の上に雪"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_text_encoder(tmp_path_factory.mktemp("text_encoder"))


@pytest.fixture(scope="module")
def enc(folder):
    return te.Qwen35TextEncoder.from_folder(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def full(folder):
    from transformers import Qwen3_5TextModel

    return Qwen3_5TextModel.from_pretrained(folder, dtype=torch.float32).eval()


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_tiny_folder_is_deterministic(folder, tmp_path):
    from pathlib import Path

    again = build_tiny_text_encoder(tmp_path / "again")
    ours = _digests(Path(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        ours
    )
    assert ours == _digests(Path(again))


def test_only_first_l_minus_2_layers(enc, full):
    assert enc.total_layers == len(full.layers) == 5
    assert len(enc.model.layers) == 3 and isinstance(enc.model.norm, torch.nn.Identity)
    assert enc.out_channels == 64


@pytest.mark.parametrize("text", PROMPTS)
def test_feature_is_output_of_layer_l_minus_3(enc, full, text):
    ids, count = enc.tokenize(text)
    assert ids == enc.tokenizer(text)["input_ids"] and count == len(ids)  # raw text, no template
    seen = {}
    hook = full.layers[len(full.layers) - 3].register_forward_hook(
        lambda mod, args, out: seen.update(out=out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            ref = full(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    feat = enc.encode(text)
    assert feat.shape == (len(ids), 64) and feat.dtype == torch.float32
    assert torch.equal(ref.hidden_states[-3][0], seen["out"][0])
    assert (feat - seen["out"][0]).abs().max().item() <= 1e-5
    assert (feat - ref.last_hidden_state[0]).abs().max().item() > 1e-2  # not the final output


def test_right_padding_batch_equals_single(enc):
    batch = enc.encode_batch(PROMPTS)
    width = max(batch.lengths)
    assert batch.features.shape == (3, width, 64) and batch.mask.shape == (3, width)
    for b, text in enumerate(PROMPTS):
        n = batch.lengths[b]
        assert batch.mask[b].tolist() == [True] * n + [False] * (width - n)
        assert (batch.features[b, :n] - enc.encode(text)).abs().max().item() <= 1e-5
        assert not batch.features[b, n:].any()
    assert batch.truncated == [False] * 3 and batch.token_counts == batch.lengths


def test_truncation_at_7000_reported(enc):
    assert MAX_TEXT_TOKENS == 7000 and enc.max_tokens == 7000
    text = " ".join(TINY_CORPUS) * 40
    count = len(enc.tokenizer(text)["input_ids"])
    assert count > 7000
    batch = enc.encode_batch([text])
    assert batch.lengths == [7000] and batch.token_counts == [count] and batch.truncated == [True]
    assert batch.features.shape == (1, 7000, 64) and bool(batch.mask.all())


def test_released_prompt_handling_is_wired_in(enc, folder):
    # the released split sits in front of the folder's own pre-tokenizer, and a JSON prompt
    # is tokenized as its compact markdown (tests/pipeline/test_prompts.py: the golden cases)
    from transformers import AutoTokenizer

    pre = enc.tokenizer.backend_tokenizer.pre_tokenizer
    assert type(pre).__name__ == "Sequence" and RELEASED_SPLIT_PATTERN[:20] in str(pre)
    prompt = json.dumps({"global_layer": {"context": "The library", "description": "Dust."}})
    ids, count = enc.tokenize(prompt)
    assert normalize_prompt(prompt) == "context: The library\nDust."
    assert ids == enc.tokenizer(normalize_prompt(prompt))["input_ids"] and count == len(ids)
    plain = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert ids != plain(normalize_prompt(prompt))["input_ids"]  # "The" -> "T", "he"


def test_empty_text_gives_one_token(enc):
    assert enc.tokenize("") == ([enc.tokenizer.pad_token_id], 0)
    assert enc.encode("").shape == (1, 64)


def test_model_dtype(folder):
    bf = te.Qwen35TextEncoder.from_folder(folder)  # default bf16, as the release runs it
    assert bf.encode_batch(["Waves"]).features.dtype == torch.bfloat16
    assert bf.encode("Waves").dtype == torch.float32


def _copy(folder, tmp_path, edit):
    dst = tmp_path / "te"
    shutil.copytree(folder, dst)
    state = dict(load_file(dst / "model.safetensors"))
    save_file(edit(state), dst / "model.safetensors")
    return dst


def test_nested_prefix_and_non_text_parts(folder, tmp_path, enc):
    def nest(s):
        out = {f"model.language_model.{k}": v for k, v in s.items()}
        out["lm_head.weight"] = torch.zeros(2, 2)
        out["model.visual.patch.weight"] = torch.zeros(3)
        return out

    nested = te.Qwen35TextEncoder.from_folder(_copy(folder, tmp_path, nest), dtype=torch.float32)
    assert torch.equal(nested.encode(PROMPTS[0]), enc.encode(PROMPTS[0]))


def test_problems_named_before_loading(folder, tmp_path):
    def break_(s):
        s.pop("layers.4.mlp.down_proj.weight")  # a layer that is never read is still checked
        s["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
        s["extra.weight"] = torch.zeros(1)
        return s

    with pytest.raises(ValueError) as err:
        te.Qwen35TextEncoder.from_folder(_copy(folder, tmp_path, break_))
    msg = str(err.value)
    assert "1 missing tensors: layers.4.mlp.down_proj.weight" in msg
    assert "1 unexpected tensors: extra.weight" in msg
    assert "layers.0.mlp.up_proj.weight: expected [128, 64], found [3, 3]" in msg
    with pytest.raises(ValueError, match="file .config.json. is missing"):
        te.Qwen35TextEncoder.from_folder(tmp_path)
