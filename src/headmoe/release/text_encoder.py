"""MAGI-2's text encoder: ``transformers``' ``Qwen3_5TextModel`` + ``AutoTokenizer``.

The feature is ``hidden_states[-3]`` of the full model, i.e. the output of decoder layer
``L - 3`` (0-based) of ``L``. Only that much is computed: the model keeps its first
``L - 2`` layers (the last two are never built or loaded) and the final norm is skipped, so
``last_hidden_state`` *is* the feature. Prompts are raw text (no chat template), tokenized
with the tokenizer's defaults, truncated at 7000 tokens, right-padded in batches; features
come out in the model dtype (bf16 for the release, 5120-d). Before tokenizing, a JSON prompt
is rewritten to compact markdown and the tokenizer carries the released extra pre-tokenizer
split (`headmoe.pipeline.prompts`), as in the release.

`build_tiny_text_encoder` writes a tiny random Qwen3.5 text model and a byte-level BPE
tokenizer trained offline on `TINY_CORPUS` to a folder in the Hugging Face format, the same
files a real ``text_encoder/`` holds, deterministically.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

import torch

from headmoe.files import check_entries, confined_file, index_map, read_json
from headmoe.pipeline.i2v import figure_token_indices
from headmoe.pipeline.prompts import add_released_split, normalize_prompt
from headmoe.pipeline.released import MAX_TEXT_TOKENS
from headmoe.release.weights import check_tensors, open_safetensors

FEATURE_LAYER = -3  # hidden_states index of the feature


@dataclass
class TextFeatures:
    """One batch: ``features [B, L_max, C]`` (model dtype, zero after each prompt's end),
    ``mask [B, L_max]`` bool, per-prompt ``lengths`` (tokens kept), ``token_counts`` (before
    truncation) and ``truncated`` flags."""

    features: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]
    token_counts: list[int]
    truncated: list[bool]


TEXT_PREFIXES = ("", "model.", "model.language_model.", "language_model.")
# Parts of a Qwen3.5 checkpoint that are not the text model (LM head, vision tower, MTP).
NON_TEXT_PARTS = ("lm_head.", "model.visual.", "visual.", "mtp.", "model.mtp.")


#: ``model_type`` values of a Qwen3.5 config (the full model nests the text model's)
QWEN35_TYPES = ("qwen3_5", "qwen3_5_text")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _text_config(folder: str):
    """The folder's ``Qwen3_5TextConfig`` (a full Qwen3.5 config nests it as text_config),
    built by transformers' own Qwen3.5 classes: an ``auto_map`` is ignored, never run
    (``trust_remote_code=False``), and another ``model_type`` is refused first."""
    from transformers import AutoConfig

    data = read_json(os.path.join(folder, "config.json"), "text encoder config")
    kind = data.get("model_type") if isinstance(data, dict) else None
    if kind not in QWEN35_TYPES:
        raise ValueError(f"text encoder config {os.path.join(folder, 'config.json')!r}: "
                         f"model_type={kind!r}, expected one of {QWEN35_TYPES}")
    cfg = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    cfg = getattr(cfg, "text_config", cfg)
    if cfg.num_hidden_layers < 3:
        raise ValueError(
            f"{folder}: text model has {cfg.num_hidden_layers} layers; hidden_states[-3] needs 3+"
        )
    return cfg


def weight_files(folder: str) -> dict[str, str]:
    """name -> safetensors file, from ``model.safetensors`` or its ``.index.json`` (every
    shard a regular file inside the folder: `headmoe.files.index_map`)."""
    check_entries(folder, f"text encoder folder {folder!r}: file")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.lexists(index):
        return index_map(index)
    single = confined_file(folder, "model.safetensors", f"text encoder folder {folder!r}: file")
    with open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single)  # noqa: SIM118


def _check_layer_count(folder: str, cfg, where: dict[str, str]) -> None:
    """Refuse a config whose layer count differs from the weights' before any skeleton of
    ``num_hidden_layers`` layers is built."""
    found = {int(m.group(1)) for n in where if not n.startswith(NON_TEXT_PARTS)
             and (m := _LAYER.search(n))}
    count = max(found) + 1 if found else 0
    if cfg.num_hidden_layers != count:
        raise ValueError(f"text encoder folder {folder!r}: config.json num_hidden_layers="
                         f"{cfg.num_hidden_layers} but the weights hold {count} layers")


def _skeleton(folder: str, cfg) -> tuple[object, dict[str, str]]:
    """The full text model on the meta device and the weights' name -> file, after the
    cheap layer-count check."""
    from transformers import Qwen3_5TextModel

    where = weight_files(folder)
    _check_layer_count(folder, cfg, where)
    with torch.device("meta"):
        return Qwen3_5TextModel(cfg), where


def _checked_names(folder: str, expected: dict[str, tuple],
                   where: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Prefix of the text model in the files, and bare name -> file. Every expected tensor
    is checked (names and shapes, all layers) before anything is read."""
    prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in where), None)
    if prefix is None:
        raise ValueError(f"{folder}: no embed_tokens.weight under any of {TEXT_PREFIXES}")
    found, by_file = {}, {}
    for name, file in where.items():
        if name.startswith(prefix) and not name.startswith(NON_TEXT_PARTS):
            by_file.setdefault(file, []).append(name)
        elif not name.startswith(NON_TEXT_PARTS):
            found[name] = ()  # reported as unexpected
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            found.update({n: tuple(f.get_slice(n).get_shape()) for n in names})
    check_tensors(found, {prefix + k: v for k, v in expected.items()}, f"{folder} (text model)")
    return prefix, {n.removeprefix(prefix): where[n] for n in found}


def _load_truncated(folder: str, dtype: torch.dtype, device) -> tuple[object, int]:
    """``Qwen3_5TextModel`` with the first ``L - 2`` layers and no final norm; ``L``."""
    from transformers import Qwen3_5TextModel

    cfg = _text_config(folder)
    full, where = _skeleton(folder, cfg)
    prefix, files = _checked_names(
        folder, {k: tuple(v.shape) for k, v in full.state_dict().items()}, where
    )
    total = cfg.num_hidden_layers
    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers, cfg.layer_types = total - 2, list(cfg.layer_types)[: total - 2]
    with torch.device("meta"):
        model = Qwen3_5TextModel(cfg)
    model.norm = torch.nn.Identity()  # the feature is taken before the final norm
    wanted = model.state_dict().keys()
    state = {}
    for file in sorted({files[k] for k in wanted}):
        with open_safetensors(file) as f:
            for k in wanted:
                if files[k] == file:
                    state[k] = f.get_tensor(prefix + k).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # non-persistent buffers (rotary inv_freq) are rebuilt
        model.rotary_emb = type(model.rotary_emb)(config=cfg)
    return model, total


TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
#: the pad token of a folder without tokenizer_config.json (Qwen's)
DEFAULT_PAD_TOKEN = "<|endoftext|>"


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer of a text-encoder folder, offline, by transformers' own classes (never
    the folder's code: ``trust_remote_code=False``), with the released pre-tokenizer split
    in front of its own: ``tokenizer.json`` with ``tokenizer_config.json`` (optional;
    without it the pad token is `DEFAULT_PAD_TOKEN`). Both are confined to the folder and
    parsed first, so a corrupt one is named. Raises `ValueError` naming the folder."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = os.fspath(folder)
    where = f"text encoder folder {folder!r}: file"
    tok_file = confined_file(folder, TOKENIZER_FILE, where)
    read_json(tok_file, "text encoder tokenizer file")
    if os.path.lexists(os.path.join(folder, TOKENIZER_CONFIG)):
        read_json(confined_file(folder, TOKENIZER_CONFIG, where), "text encoder tokenizer file")
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=False)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=tok_file)
        if DEFAULT_PAD_TOKEN in tok.get_vocab():
            tok.pad_token = DEFAULT_PAD_TOKEN
    if tok.pad_token_id is None:
        raise ValueError(f"text encoder folder {folder!r}: the tokenizer has no pad token")
    add_released_split(tok)
    return tok


def kept_tokens(tokenizer, text: str, max_tokens: int = MAX_TEXT_TOKENS
                ) -> tuple[list[int], int]:
    """Token ids of ``normalize_prompt(text)`` the encoder keeps (at most ``max_tokens``;
    "" becomes one pad token) and the count before truncation."""
    ids = tokenizer(normalize_prompt(text))["input_ids"]
    return ids[:max_tokens] or [tokenizer.pad_token_id], len(ids)


class TokenCounter:
    """``count(text) -> int``: the tokens the encoder of ``folder`` keeps of ``text`` (what
    admission's memory estimate needs; loads only the tokenizer, once, on first use;
    picklable: the tokenizer is not pickled)."""

    def __init__(self, folder: str | os.PathLike, max_tokens: int = MAX_TEXT_TOKENS):
        self.folder, self.max_tokens, self._tok = os.fspath(folder), max_tokens, None

    def __call__(self, text: str) -> int:
        if self._tok is None:
            self._tok = load_tokenizer(self.folder)
        return len(kept_tokens(self._tok, text, self.max_tokens)[0])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None}


def model_dtype(folder: str | os.PathLike) -> torch.dtype:
    """The folder's model dtype (``dtype`` / ``torch_dtype`` of ``config.json``, the outer
    config first; bfloat16 when it names none): the dtype MAGI-2 runs the encoder in."""
    data = read_json(os.path.join(os.fspath(folder), "config.json"), "text encoder config")
    for section in (data, data.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
    return torch.bfloat16


def check_text_encoder(folder: str | os.PathLike) -> int:
    """Check a ``text_encoder/`` folder without reading any weight: ``config.json``, the
    tokenizer (`load_tokenizer`, offline) and every tensor header of the text
    model (names and shapes, all layers). Returns the feature width (``hidden_size``).
    Raises `ValueError` naming the file or tensors."""
    folder = os.fspath(folder)
    confined_file(folder, "config.json", f"text encoder folder {folder!r}: file")
    cfg = _text_config(folder)
    full, where = _skeleton(folder, cfg)
    _checked_names(folder, {k: tuple(v.shape) for k, v in full.state_dict().items()}, where)
    load_tokenizer(folder)
    return int(cfg.hidden_size)


class Qwen35TextEncoder:
    """`headmoe.pipeline.interfaces.TextEncoder` over a (truncated) ``Qwen3_5TextModel``.

    Construct with `from_folder`. ``encode(text) -> [L, C]`` float32 (model-dtype values);
    `encode_batch` gives the batched form with the truncation report."""

    def __init__(self, model, tokenizer, total_layers: int, max_tokens: int = MAX_TEXT_TOKENS):
        self.model, self.tokenizer = model, tokenizer
        self.total_layers, self.max_tokens = total_layers, max_tokens
        self.out_channels = int(model.config.hidden_size)
        if tokenizer.pad_token_id is None:
            raise ValueError("text encoder tokenizer has no pad token")

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        max_tokens: int = MAX_TEXT_TOKENS,
    ) -> Qwen35TextEncoder:
        """Load ``config.json``, the safetensors weights (``model.safetensors`` or an index;
        the text model may sit under ``model.`` / ``model.language_model.``, LM head, vision
        and MTP tensors are skipped by name) and the tokenizer files from ``folder``,
        offline, with the released pre-tokenizer split in front of the tokenizer's own. All
        tensors are checked by name and shape first; the last two decoder layers and the
        final norm are then not read."""
        folder = os.fspath(folder)
        confined_file(folder, "config.json", f"text encoder folder {folder!r}: file")
        model, total = _load_truncated(folder, dtype, device)
        return cls(model.eval(), load_tokenizer(folder), total, max_tokens)

    def tokenize(self, text: str) -> tuple[list[int], int]:
        """`kept_tokens` of ``text``: ids of ``normalize_prompt(text)`` (at most
        ``max_tokens``; "" becomes one pad token) and the count before truncation."""
        return kept_tokens(self.tokenizer, text, self.max_tokens)

    def figure_indices(self, text: str) -> list[int]:
        """Indices of the tokens that spell the ``<Figure 1>`` marker in ``text`` as
        `tokenize` reads it (`i2v.figure_token_indices` over the tokenizer's character
        offsets into ``normalize_prompt(text)``), less any that truncation drops."""
        seen = normalize_prompt(text)
        offsets = self.tokenizer(seen, return_offsets_mapping=True)["offset_mapping"]
        return [i for i in figure_token_indices(seen, offsets) if i < self.max_tokens]

    @torch.no_grad()
    def encode_batch(self, texts: list[str]) -> TextFeatures:
        """Right-padded batch through the first ``L - 2`` layers: ``hidden_states[-3]``."""
        toks = [self.tokenize(t) for t in texts]
        lengths = [len(ids) for ids, _ in toks]
        width = max(lengths)
        device = self.model.embed_tokens.weight.device
        ids = torch.full((len(texts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(texts), width, dtype=torch.bool)
        for b, (row, _) in enumerate(toks):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = True
        out = self.model(
            input_ids=ids.to(device), attention_mask=mask.long().to(device), use_cache=False
        ).last_hidden_state
        feats = out.masked_fill(~mask.to(device)[..., None], 0).cpu()
        counts = [c for _, c in toks]
        return TextFeatures(feats, mask, lengths, counts, [c > self.max_tokens for c in counts])

    def encode(self, text: str) -> torch.Tensor:
        """``[L_text, out_channels]`` float32, ``1 <= L_text <= max_tokens``."""
        res = self.encode_batch([text])
        return res.features[0, : res.lengths[0]].float()
