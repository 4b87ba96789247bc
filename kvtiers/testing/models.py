"""Random-weight Llama models for engine tests and benchmarks: no model hub needed.

:func:`make_random_llama` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, a word-level ``tokenizer.json``) that vLLM loads like any local
model. The weights come from a fixed seed, so two directories made with one seed and one
:class:`LlamaShape` hold the same model. The tokenizer maps ``w<id>`` (and a few specials
at the first ids) to ids, splitting on whitespace: a prompt of ``n`` words is ``n``
tokens, and decoding ids and encoding the text again gives the same ids.

torch, transformers and tokenizers are imported only when a model is made.

As a command, ``python -m kvtiers.testing.models DIR`` writes one (a 2-layer Llama of
hidden size 128, :data:`TINY`, unless ``--layers``, ``--hidden`` ... say otherwise) that
vLLM serves from ``DIR`` (``--model DIR``): a model to try kvtiers with, no download.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

#: Special tokens, at the first ids.
SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class LlamaShape:
    """The size of a random Llama. KV bytes per token (float32) are
    ``layers * 2 * kv_heads * (hidden / heads) * 4``."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 1024
    max_positions: int = 2048

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V one token occupies over all layers."""
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * dtype_bytes


def word(token_id: int, vocab: int) -> str:
    """The word the tokenizer maps to ``token_id`` (ids past the specials only)."""
    if not len(SPECIALS) <= token_id < vocab:
        raise ValueError(f"token id {token_id} is outside the words [{len(SPECIALS)}, {vocab})")
    return f"w{token_id}"


def _tokenizer_files(out: Path, shape: LlamaShape) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({word(i, shape.vocab): i for i in range(len(SPECIALS), shape.vocab)})
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
                "model_max_length": shape.max_positions,
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


def make_random_llama(out: Path, shape: LlamaShape, *, seed: int = 0) -> Path:
    """Write a Llama of ``shape`` into ``out`` (created if missing) and return ``out``.

    float32 weights drawn from ``seed`` with a standard deviation of 0.3 (Llama's default
    0.02 makes greedy outputs repeat one token, which says little about the KV they were
    computed from).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
        **_UNLISTED,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer_files(out, shape)
    return out


#: The command's default shape: 2 layers, hidden size 128, 4 attention heads over 2 KV
#: heads, a vocabulary of 1024 words (tests/e2e's model).
TINY = LlamaShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvtiers.testing.models DIR``: write a random-weight Llama into DIR."""
    parser = argparse.ArgumentParser(
        prog="python -m kvtiers.testing.models",
        description="Write a random-weight Llama (config.json, model.safetensors, a "
                    "word-level tokenizer: the prompt 'w5 w6 w7' is three tokens) into DIR, "
                    "for vLLM to serve with --model DIR: no model hub needed. Its outputs "
                    "are not language; they are the same for the same seed and shape. "
                    "Needs torch, transformers and tokenizers (a vLLM install has them).")
    parser.add_argument("out", metavar="DIR", help="the model directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    for shape_field in fields(LlamaShape):
        default = getattr(TINY, shape_field.name)
        parser.add_argument(f"--{shape_field.name.replace('_', '-')}", type=int,
                            default=default, metavar="N", help=f"default {default}")
    args = parser.parse_args(argv)
    shape = LlamaShape(**{f.name: getattr(args, f.name) for f in fields(LlamaShape)})
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    out = make_random_llama(Path(args.out), shape, seed=args.seed)
    print(f"{out}: a random Llama, {shape.layers} layers, hidden {shape.hidden}, vocabulary "
          f"{shape.vocab}, {shape.kv_bytes_per_token()} bytes of float32 KV per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
