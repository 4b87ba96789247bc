"""A tiny random-weight Llama for engine tests: no model hub, a few seconds on one core.

:func:`make_tiny_llama` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, a word-level ``tokenizer.json``) that vLLM loads like any local
model, through :func:`kvtiers.testing.models.make_random_llama`. The weights come from a
fixed seed, so two directories made with one seed hold the same model. The tokenizer maps
``w0`` … ``w{n}`` (and a few specials) to ids; prompts for the tests are sequences of
those words, one token each.

Run it as a script to make a model by hand::

    python -m tests.e2e.tiny_model DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtiers.testing.models import SPECIALS, LlamaShape, make_random_llama
from kvtiers.testing.models import _tokenizer_files as tokenizer_files
from kvtiers.testing.models import word as _word

__all__ = [
    "MAX_POSITIONS",
    "SLIDING_WINDOW",
    "SPECIALS",
    "TINY",
    "VOCAB",
    "make_tiny_gemma3",
    "make_tiny_lfm2",
    "make_tiny_llama",
    "word",
]

#: Vocabulary size; every id below it is a word ``w<id>`` or a special token.
VOCAB = 1024
#: The longest sequence the model accepts (prompt plus generated tokens).
MAX_POSITIONS = 2048
#: 2 layers, hidden size 128, 4 attention heads over 2 KV heads.
TINY = LlamaShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=VOCAB,
                  max_positions=MAX_POSITIONS)


def word(token_id: int) -> str:
    """The word the tokenizer maps to ``token_id`` (ids past the specials only)."""
    return _word(token_id, VOCAB)


def make_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama (:data:`TINY`) into ``out`` (created if missing), return ``out``."""
    return make_random_llama(out, TINY, seed=seed)


#: Tokens the tiny Gemma 3's sliding-window layer attends back (two blocks of 32).
SLIDING_WINDOW = 64


def make_tiny_gemma3(out: Path, *, seed: int = 0) -> Path:
    """Write a tiny random Gemma 3 (text only) into ``out``: one sliding-window layer
    (:data:`SLIDING_WINDOW` tokens) and one full-attention layer, the shape of :data:`TINY`
    otherwise, so vLLM gives it two KV-cache groups of different kinds (a sliding-window
    group and a full-attention group). Weights as :func:`make_tiny_llama`'s (standard
    deviation 0.3, from ``seed``, the output embedding untied); the same word-level
    tokenizer."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out.mkdir(parents=True, exist_ok=True)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=TINY.hidden,
        intermediate_size=TINY.intermediate,
        num_hidden_layers=2,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        head_dim=TINY.hidden // TINY.heads,
        query_pre_attn_scalar=TINY.hidden // TINY.heads,
        max_position_embeddings=MAX_POSITIONS,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
        # Tied embeddings make the output repeat the input token (the residual stream holds
        # its scaled embedding): untied, outputs depend on the prefix.
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model: Any = Gemma3ForCausalLM(config)
    model = model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_files(out, TINY)
    return out


def make_tiny_lfm2(out: Path, *, seed: int = 0) -> Path:
    """Write a tiny random LFM2 into ``out``: a short-convolution layer (a state vLLM keeps
    per request, its ``MambaSpec`` group) and a full-attention layer, the shape of
    :data:`TINY` otherwise, the output embedding untied; the same word-level tokenizer.
    vLLM reads ``conv_dim``, ``conv_dim_out`` and ``block_dim`` from the config, which
    transformers' ``Lfm2Config`` does not write: they are set to the hidden size."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=TINY.hidden,
        intermediate_size=TINY.intermediate,
        num_hidden_layers=2,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        layer_types=["conv", "full_attention"],
        block_auto_adjust_ff_dim=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.conv_dim = config.conv_dim_out = config.block_dim = TINY.hidden
    torch.manual_seed(seed)
    model: Any = Lfm2ForCausalLM(config)
    model = model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_files(out, TINY)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    print(make_tiny_llama(args.out, seed=args.seed))


if __name__ == "__main__":
    main()
