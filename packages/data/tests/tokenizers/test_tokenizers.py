import pytest
import sentencepiece
import tiktoken
import tiktoken.load
from tokenizers import Tokenizer as HFTokenizer

from mtl.core.errors import DataError
from mtl.core.plugins import registry
from mtl.data.tokenizers.base import Tokenizer
from mtl.data.tokenizers.tiktoken_bpe import GPT2_PATTERN, TiktokenTokenizer

EOD = "<|endoftext|>"

SAMPLES = [
    "The red train from Oslo to Lima leaves at 8:40. The train is on time.",
    "There are three foxes in the field.  Two more come.\nNow there are five foxes!",
    "unseen wörds, ümlauts and emoji 🚂 still round-trip",
]


def build(name, model=None):
    return registry("tokenizer").get(name).build(None if model is None else str(model))


def test_byte_tokenizer_round_trip_and_ids():
    tok = build("byte")
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids + [tok.eod]) == text


def test_gpt2_bpe_matches_the_trained_library_tokenizer(bpe_dir, bpe_vocab):
    tok = build("gpt2-bpe", bpe_dir)
    reference = HFTokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    assert tok.eod == bpe_vocab[EOD] and tok.vocab_size == len(bpe_vocab) == 400
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == reference.encode(text).ids
        assert len(ids) < len(text.encode("utf-8"))  # merges were applied
        assert tok.decode(ids) == text
    # the vocab.json path (merges.txt beside it) is accepted too
    assert build("gpt2-bpe", bpe_dir / "vocab.json").encode(SAMPLES[0]) == tok.encode(SAMPLES[0])


def test_hf_tokenizer_json(bpe_dir, bpe_vocab):
    tok = build("hf", bpe_dir / "tokenizer.json")
    reference = HFTokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    assert tok.eod == bpe_vocab[EOD] and tok.vocab_size == 400
    for text in SAMPLES:
        assert tok.encode(text) == reference.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    assert build("hf", bpe_dir).eod == tok.eod  # a folder holding tokenizer.json


def test_sentencepiece(spm_model):
    tok = build("sentencepiece", spm_model)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    assert tok.vocab_size == 150 and tok.eod == reference.eos_id() == 2
    # only characters the tiny model saw in training (others decode to the unknown piece)
    texts = [SAMPLES[0], "There are three foxes in the field.  Two more come.\nNow there are five."]
    for text in texts:
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        assert tok.decode(ids) == " ".join(text.split())  # SentencePiece normalises whitespace
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_tiktoken_file_agrees_with_tiktoken_and_with_the_same_bpe(tiktoken_file, bpe_dir, byte_of_char):
    tok = build("tiktoken", tiktoken_file)
    assert tok.vocab_size == 400 - 1 + 1  # 399 ranks (no special) + eod
    assert tok.eod == 399
    reference = tiktoken.Encoding("ref", pat_str=tok.model._pat_str,
                                  mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(tiktoken_file)),
                                  special_tokens={EOD: 399})
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == reference.encode_ordinary(text)
        assert tok.decode(ids) == text
    assert tok.encode(EOD) != [tok.eod]  # special text in a document is plain text
    # With GPT-2's split regex the tiktoken ranks and the byte-level BPE give the same pieces.
    gpt2_style = TiktokenTokenizer(str(tiktoken_file), pattern=GPT2_PATTERN)
    bpe = build("gpt2-bpe", bpe_dir)
    for text in SAMPLES:
        bpe_pieces = [bytes(byte_of_char[c] for c in bpe.model.id_to_token(i)) for i in bpe.encode(text)]
        tik_pieces = [gpt2_style.model.decode_single_token_bytes(i) for i in gpt2_style.encode(text)]
        assert tik_pieces == bpe_pieces


@pytest.mark.parametrize("name", ["hf", "gpt2-bpe", "sentencepiece", "tiktoken"])
def test_missing_model_file_is_a_data_error(name, tmp_path):
    with pytest.raises(DataError, match="set data.tokenizer_model"):
        build(name)
    missing = tmp_path / "nope.model"
    with pytest.raises(DataError, match=str(missing)):
        build(name, missing)


def test_unreadable_model_files_are_named(tmp_path):
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00not a model")
    with pytest.raises(DataError, match="junk.model"):
        build("sentencepiece", junk)
    with pytest.raises(DataError, match="junk.model"):
        build("hf", junk)
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(DataError, match="bad.tiktoken line 2"):
        build("tiktoken", bad)
