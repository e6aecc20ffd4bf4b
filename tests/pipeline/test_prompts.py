"""The released prompt handling against golden/magi2_pipeline part (c): JSON -> compact
markdown (every `normalize_prompt` case), the released pre-tokenizer split with its
malformed character class (ids and offsets of every prompt of ``tokenization.json``), and
the released default negative prompt, byte for byte."""

import json

import pytest

from headmoe.pipeline.prompts import RELEASED_SPLIT_PATTERN, add_released_split, normalize_prompt
from headmoe.pipeline.released import RELEASED_NEGATIVE_PROMPT
from tests.goldens import golden_dir, golden_file

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden


def _json(name):
    return json.loads(golden_file("magi2_pipeline", name).read_text(encoding="utf-8"))


PROMPTS = _json("prompts.json")
TOKENIZATION = _json("tokenization.json")


def test_every_case_is_here():
    assert len(PROMPTS["normalize_prompt"]) == 16 and len(TOKENIZATION["prompts"]) == 11


@pytest.mark.parametrize("name", sorted(PROMPTS["normalize_prompt"]))
def test_normalize_prompt(name):
    case = PROMPTS["normalize_prompt"][name]
    assert normalize_prompt(case["input"]) == case["output"]


@pytest.mark.parametrize("name", sorted(PROMPTS["ensure_figure_token"]))
def test_normalize_prompt_of_figure_prompts(name):
    case = PROMPTS["ensure_figure_token"][name]
    assert normalize_prompt(case["output"]) == case["normalized_output"]


def test_deeply_nested_json_is_used_as_written():
    for text in ("[" * 50_000, "[" * 990 + "]" * 990,
                 '{"global_layer": ' + "[" * 985 + "]" * 985 + "}"):
        assert normalize_prompt(text) == text


@pytest.fixture(scope="module")
def tokenizers():
    """(the golden tokenizer with the released split, the same without it)."""
    from transformers import AutoTokenizer

    folder = golden_dir("magi2_pipeline") / "tokenizer"
    plain = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="right")
    split = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="right")
    add_released_split(split)
    return split, plain


def _encode(tok, text):
    enc = tok([text], return_offsets_mapping=True)
    return enc["input_ids"][0], [list(o) for o in enc["offset_mapping"][0]]


@pytest.mark.parametrize("name", sorted(TOKENIZATION["prompts"]))
def test_released_split_ids_and_offsets(tokenizers, name):
    case = TOKENIZATION["prompts"][name]
    text = normalize_prompt(case["prompt"])
    assert text == case["normalized"]
    split, plain = tokenizers
    assert _encode(split, text) == (case["split"]["input_ids"], case["split"]["offsets"])
    assert _encode(plain, text) == (case["no_split"]["input_ids"], case["no_split"]["offsets"])
    assert (case["split"]["input_ids"] != case["no_split"]["input_ids"]) == case["differs"]


def test_split_pattern_is_the_released_raw_string(tokenizers):
    assert len(RELEASED_SPLIT_PATTERN) == 103
    assert RELEASED_SPLIT_PATTERN.startswith(r"([\u1100-\u11ff") and r"\U00020000" in (
        RELEASED_SPLIT_PATTERN)
    # the malformed class isolates digits, :;<=>?@ and A-U (a literal range 0-U), not V-Z
    split, plain = tokenizers
    isolated = TOKENIZATION["tokenizer"]["ascii_isolated_by_split"]
    assert set(isolated) >= set(":;<=>?@ABCDEFGHIJKLMNOPQRSTU") and not set(isolated) & set("VWXYZ")
    assert len(split("NASA")["input_ids"]) == 4


def test_released_negative_prompt_byte_exact():
    golden = golden_file("magi2_pipeline", "negative_prompt.txt").read_bytes()
    assert RELEASED_NEGATIVE_PROMPT.encode("utf-8") == golden
    assert len(RELEASED_NEGATIVE_PROMPT) == 1721
