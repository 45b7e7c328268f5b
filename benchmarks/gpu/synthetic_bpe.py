"""A byte-level BPE tokenizer as wide as a benchmark model's vocabulary, built in memory.

The reference config names the byte tokenizer (257 ids) for a 50,304-row model, and a random
model samples any of those rows, which no 257-id tokenizer can decode. Timing the server as
it runs (each token detokenized) needs a tokenizer that decodes every id the way a real
GPT-2-style one does: this one starts from the 256 byte symbols of byte-level BPE and adds
merges of two existing tokens (up to 8 bytes long, seeded) until the vocabulary is full, the
last id being ``<|endoftext|>``. Its decoding work (byte-level pieces, multi-byte characters
split across tokens) is a real BPE tokenizer's; no network or files needed."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from mtl.core.plugins import registry

_MAX_TOKEN_CHARS = 8


def synthetic_bpe(vocab_size: int, seed: int = 0):
    """An mtl ``hf`` tokenizer of exactly ``vocab_size`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    tokens, merges, rng = list(symbols), [], random.Random(seed)
    while len(vocab) < vocab_size - 1:
        left, right = rng.choice(tokens), rng.choice(tokens)
        merged = left + right
        if len(merged) > _MAX_TOKEN_CHARS or merged in vocab:
            continue
        vocab[merged] = len(vocab)
        tokens.append(merged)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path = Path(tempfile.mkdtemp(prefix="bench_bpe_")) / "tokenizer.json"
    tok.save(str(path))
    built = registry("tokenizer").get("hf").build(str(path))
    assert built.vocab_size == vocab_size, (built.vocab_size, vocab_size)
    return built
