"""Incremental detokenization: for byte-level BPE, WordPiece, SentencePiece (byte fallback) and
the byte tokenizer, the deltas of random token streams add up to decoding the whole stream,
and each step decodes a few ids, not the whole output."""

from __future__ import annotations

import random

import pytest

from mtl.core.plugins import registry
from mtl.serve.detokenize import TextStream

CORPUS = ["the quick brown fox jumps over the lazy dog.", "hello world, hello server!", "don't stop: café, naïve, "
          "日本語のテキスト", "pack my box with five dozen liquor jugs?", "tokens stream out one at a time"] * 20


def _hf(folder, model, pre_tokenizer, decoder, trainer):
    from tokenizers import Tokenizer

    tok = Tokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return registry("tokenizer").get("hf").build(str(folder / "tokenizer.json"))


def byte_level_bpe(folder):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    return _hf(folder, models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
               trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))


def wordpiece(folder):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    return _hf(folder, models.WordPiece(unk_token="[UNK]"), pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(),
               trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))


def sentencepiece(folder):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(folder / "sp"), vocab_size=320,
                                   byte_fallback=True, character_coverage=1.0, minloglevel=2)
    return registry("tokenizer").get("sentencepiece").build(str(folder / "sp.model"))


def byte(_folder):
    return registry("tokenizer").get("byte").build(None)


def stream_text(tokenizer, prompt: list[int], ids: list[int], stop=()) -> tuple[str, int]:
    """The deltas of ``ids`` given one at a time, as the engine does; and the most ids one
    decode call saw."""
    seen = []
    decode = tokenizer.decode
    tokenizer.decode = lambda window: (seen.append(len(window)), decode(window))[1]
    try:
        text = TextStream(tokenizer, prompt, stop)
        pieces = []
        for k, token in enumerate(ids):
            final = k == len(ids) - 1
            text.update([token], final=final)
            pieces.append(text.delta(final=final or text.stopped))
            if text.stopped:
                break
    finally:
        del tokenizer.decode
    return "".join(pieces), max(seen)


@pytest.mark.parametrize("build", [byte_level_bpe, wordpiece, sentencepiece, byte])
def test_deltas_of_random_streams_equal_decoding_the_whole(build, tmp_path):
    tokenizer = build(tmp_path)
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        prompt = tokenizer.encode(rng.choice(CORPUS)) if trial % 2 else []
        text, _ = stream_text(tokenizer, prompt, ids)
        if prompt:  # the continuation of the prompt's text
            head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + ids)
            assert whole.startswith(head)
            assert text == whole[len(head):], (prompt, ids)
        else:
            assert text == tokenizer.decode(ids), ids


@pytest.mark.parametrize("build", [byte_level_bpe, sentencepiece])
def test_a_step_decodes_a_window_not_the_whole_output(build, tmp_path):
    tokenizer = build(tmp_path)
    ids = tokenizer.encode(" ".join(CORPUS))  # hundreds of ids of text with multi-byte characters
    assert len(ids) > 500
    text, widest = stream_text(tokenizer, ids[:5], ids[5:])
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:5])):]
    assert widest <= 12, widest


def test_a_stop_string_across_deltas_ends_the_text_before_it(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode("hello world, hello server! the quick brown fox")
    text, _ = stream_text(tokenizer, [], ids, stop=("server!", "zzz"))
    assert text == "hello world, hello "


def test_a_character_the_prompt_cut_and_the_first_token_completes_is_given_out(tmp_path):
    tokenizer = byte(tmp_path)
    ids = tokenizer.encode("ok日xy")  # 日 is 3 bytes: the prompt ends on its first two
    assert stream_text(tokenizer, ids[:4], ids[4:])[0] == "日xy"
    assert stream_text(tokenizer, ids[:4], ids[4:5])[0] == "日"
