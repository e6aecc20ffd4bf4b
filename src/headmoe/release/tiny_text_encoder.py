"""A tiny random Qwen3.5 text model and an offline byte-level BPE tokenizer, saved as a
Hugging Face folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``) that `Qwen35TextEncoder.from_folder` reads like a real
``text_encoder/``. Deterministic: the tokenizer is trained on the fixed `TINY_CORPUS`, the
weights come from a fixed seed."""

from __future__ import annotations

import os

import torch

TINY_SEED = 1001
PAD, EOS = "<|pad|>", "<|endoftext|>"
TINY_CORPUS = (
    "A red fox runs across a snowy field at dawn, its breath visible in the cold air.",
    "Waves crash against the rocks while seagulls circle above the lighthouse.",
    "A woman in a blue dress plays the violin on a busy street corner in the rain.",
    "The camera slowly pans over a city skyline as the lights come on at dusk.",
    "Two children laugh and chase each other through a field of tall sunflowers.",
    "An old man reads a newspaper on a park bench; pigeons gather at his feet.",
    "Close-up of coffee being poured into a white cup, steam rising, soft music.",
    "A drummer counts in: one, two, three, four! The band starts playing loudly.",
    "Low quality, blurry, distorted faces, extra limbs, watermark, text, jpeg artifacts.",
    "Der Zug fährt durch die Berge; 山の上に雪が降る; le vent souffle sur la mer.",
    "0123456789 #$%&*()[]{}<>/\\|@^_~`'\" +-=.,;:?!",
)


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE (``tokenizers``) trained on `TINY_CORPUS`, wrapped as a
    ``PreTrainedTokenizerFast`` with pad and eos tokens; no BOS is added (as Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(TINY_CORPUS) * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def tiny_config(vocab_size: int, hidden_size: int = 64, layers: int = 5):
    """A small ``Qwen3_5TextConfig``: linear-attention (Gated DeltaNet) and full-attention
    layers as in the release's 3:1 pattern, partial rotary embedding."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        layer_types=[
            ("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)
        ],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=0,
        eos_token_id=1,
    )


def build_tiny_text_encoder(
    folder: str | os.PathLike, seed: int = TINY_SEED, hidden_size: int = 64, layers: int = 5
) -> str:
    """Write the tiny model + tokenizer to ``folder`` (created) and return its path."""
    from transformers import Qwen3_5TextModel

    folder = os.fspath(folder)
    tok = train_tokenizer()
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1, "special token ids moved"
    cfg = tiny_config(len(tok), hidden_size, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5TextModel(cfg).float()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
