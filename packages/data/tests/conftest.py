"""Tiny real tokenizer files, trained here on the demo corpus (nothing is downloaded)."""

from __future__ import annotations

import base64
import json
import random

import pytest

from mtl.data.demo_corpus import demo_document

EOD = "<|endoftext|>"


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (a fact of the vocab format)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    rng = random.Random(7)
    return [demo_document(rng) for _ in range(300)]


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory, corpus_texts):
    """vocab.json + merges.txt + tokenizer.json of a 400-token byte-level BPE."""
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_texts, vocab_size=400, min_frequency=2,
                            special_tokens=[EOD], show_progress=False)
    bpe.save_model(str(out))
    bpe.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory, corpus_texts):
    import sentencepiece

    out = tmp_path_factory.mktemp("spm")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts), model_prefix=str(out / "tiny"), vocab_size=150,
        model_type="bpe", character_coverage=1.0, minloglevel=2, num_threads=1)
    return out / "tiny.model"


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory, bpe_dir):
    """The trained BPE rewritten as tiktoken ranks: 256 bytes, then each merge in order."""
    to_byte = {c: b for b, c in gpt2_bytes_to_unicode().items()}
    tokens = [bytes([b]) for b in range(256)]
    merges = (bpe_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    for line in merges:
        if not line or line.startswith("#version"):
            continue
        left, right = line.split(" ")
        tokens.append(bytes(to_byte[c] for c in left + right))
    path = tmp_path_factory.mktemp("tiktoken") / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n"
                            for rank, t in enumerate(tokens)))
    return path


@pytest.fixture(scope="session")
def byte_of_char() -> dict[str, int]:
    """GPT-2 vocab character -> the byte it stands for."""
    return {c: b for b, c in gpt2_bytes_to_unicode().items()}


@pytest.fixture(scope="session")
def bpe_vocab(bpe_dir) -> dict[str, int]:
    return json.loads((bpe_dir / "vocab.json").read_text(encoding="utf-8"))


BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="session")
def wordpiece_dir(tmp_path_factory, corpus_texts):
    """A 300-token lowercase WordPiece tokenizer.json (+ tokenizer_config.json naming its
    special tokens, as a Hugging Face BERT folder does)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    out = tmp_path_factory.mktemp("wordpiece")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(corpus_texts, vocab_size=300, min_frequency=2,
                                  special_tokens=BERT_SPECIAL_TOKENS, show_progress=False)
    wordpiece.save(str(out / "tokenizer.json"))
    roles = dict(zip(["pad_token", "unk_token", "cls_token", "sep_token", "mask_token"], BERT_SPECIAL_TOKENS))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", **roles}))
    return out


@pytest.fixture
def single_process_group(tmp_path):
    """A one-rank gloo group: Megatron-Core's dataset builders ask torch.distributed for the rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


T5_SENTINELS = [f"<extra_id_{i}>" for i in range(40)]


@pytest.fixture(scope="session")
def t5_spm_model(tmp_path_factory, corpus_texts):
    """A 250-piece SentencePiece model laid out as T5's (pad 0, eos 1, unk 2) plus <s> and
    40 sentinel pieces."""
    import sentencepiece

    out = tmp_path_factory.mktemp("t5_spm")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts), model_prefix=str(out / "t5"), vocab_size=250,
        model_type="unigram", character_coverage=1.0, minloglevel=2, num_threads=1,
        pad_id=0, eos_id=1, unk_id=2, bos_id=3, user_defined_symbols=T5_SENTINELS)
    return out / "t5.model"


@pytest.fixture(scope="session")
def t5_wordpiece_dir(tmp_path_factory, corpus_texts):
    """A WordPiece tokenizer.json with Megatron-LM's T5 extras: [BOS], [EOS] and sentinels."""
    from tokenizers.implementations import BertWordPieceTokenizer

    out = tmp_path_factory.mktemp("t5_wordpiece")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(corpus_texts, vocab_size=300, min_frequency=2, show_progress=False,
                                  special_tokens=BERT_SPECIAL_TOKENS + ["[BOS]", "[EOS]"] + T5_SENTINELS)
    wordpiece.save(str(out / "tokenizer.json"))
    roles = dict(zip(["pad_token", "unk_token", "cls_token", "sep_token", "mask_token", "bos_token",
                      "eos_token"], BERT_SPECIAL_TOKENS + ["[BOS]", "[EOS]"]))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", **roles, "additional_special_tokens": T5_SENTINELS}))
    return out


@pytest.fixture(scope="session")
def t5_sentinels() -> list[str]:
    return T5_SENTINELS
