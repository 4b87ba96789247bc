"""A tiny random-weight Llama for engine tests: no model hub, a few seconds on one core.

:func:`make_tiny_llama` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, a word-level ``tokenizer.json``) that vLLM loads like any local
model. The weights come from a fixed seed, so two directories made with one seed hold the
same model. The tokenizer maps ``w0`` … ``w{n}`` (and a few specials) to ids; prompts for
the tests are sequences of those words, one token each.

Run it as a script to make a model by hand::

    python -m tests.e2e.tiny_model DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Vocabulary size; every id below it is a word ``w<id>`` or a special token.
VOCAB = 1024
#: Special tokens, at the first ids.
SPECIALS = ("<unk>", "<s>", "</s>")
#: The longest sequence the model accepts (prompt plus generated tokens).
MAX_POSITIONS = 2048


def word(token_id: int) -> str:
    """The word the tokenizer maps to ``token_id`` (ids past the specials only)."""
    if not len(SPECIALS) <= token_id < VOCAB:
        raise ValueError(f"token id {token_id} is outside the words [{len(SPECIALS)}, {VOCAB})")
    return f"w{token_id}"


def _tokenizer_files(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({word(i): i for i in range(len(SPECIALS), VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": MAX_POSITIONS,
                "add_bos_token": False,
                "add_eos_token": False,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    )


# Keyword arguments LlamaConfig's annotations may not list (they vary by release).
_UNLISTED: dict[str, Any] = {"torch_dtype": "float32"}


def make_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama into ``out`` (created if missing) and return ``out``.

    2 layers, hidden size 128, 4 attention heads over 2 KV heads, float32 weights drawn
    from ``seed`` with a standard deviation of 0.3 (Llama's default 0.02 makes greedy
    outputs repeat one token, which says little about the KV they were computed from).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
        **_UNLISTED,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer_files(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    print(make_tiny_llama(args.out, seed=args.seed))


if __name__ == "__main__":
    main()
