"""``preprocess(split_sentences=True)`` writes the bytes Megatron's ``preprocess_data.py
--split-sentences`` writes: each sentence a sequence, documents as runs of sentences."""

import json
import sys

import numpy as np
import pytest

from mtl.core.errors import DataError
from mtl.core.plugins import registry
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.indexed_dataset import IndexedDataset
from mtl.data.preprocess import preprocess
from mtl.data.sentence_split import build_sentence_splitter

pytest.importorskip("nltk")
megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = write_demo_corpus(str(tmp_path_factory.mktemp("split") / "demo.jsonl"), num_docs=120, seed=5)
    with open(path, "a", encoding="utf-8") as f:
        # an empty document (no sentences) and one whose "sentences" include bare punctuation
        f.write(json.dumps({"text": ""}) + "\n")
        f.write(json.dumps({"text": "Short one. ! Then a last sentence."}) + "\n")
    return path


def megatron_preprocess(corpus, prefix, tokenizer, splitter, append_eod):
    """What Megatron's Encoder.encode + IndexedDatasetBuilder do with the same sentences."""
    builder = megatron_indexed.IndexedDatasetBuilder(
        prefix + ".bin", dtype=megatron_indexed.DType.optimal_dtype(tokenizer.vocab_size))
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            doc_ids, sentence_lens = [], []
            for sentence in splitter.split(json.loads(line)["text"]):
                ids = tokenizer.encode(sentence)
                if ids:
                    doc_ids += ids
                    sentence_lens.append(len(ids))
            if doc_ids and append_eod:
                doc_ids.append(tokenizer.eod)
                sentence_lens[-1] += 1
            builder.add_document(doc_ids, sentence_lens)
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("append_eod", [False, True])
def test_split_sentences_writes_megatrons_bytes(corpus, bpe_dir, tmp_path, append_eod):
    tokenizer = registry("tokenizer").get("hf").build(str(bpe_dir / "tokenizer.json"))
    stats = preprocess(corpus, str(tmp_path / "ours"), "hf", str(bpe_dir / "tokenizer.json"),
                       append_eod=append_eod, progress=False, split_sentences=True)
    megatron_preprocess(corpus, str(tmp_path / "theirs"), tokenizer, build_sentence_splitter(), append_eod)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()

    ours = IndexedDataset(str(tmp_path / "ours"))
    sentences_per_doc = np.diff(ours.document_indices)
    assert stats.docs == ours.num_documents == 122 and stats.sequences == len(ours)
    assert sentences_per_doc[-2] == 0 and sentences_per_doc[-1] == 3  # "!" is a sentence of its own
    assert sentences_per_doc[:120].min() >= 3  # every demo document has at least three sentences
    assert "Punkt" in stats.splitter
    first = tokenizer.decode(ours[0].tolist())
    assert first.strip().endswith(".") and first.count(". ") == 0  # one sentence per sequence


def test_workers_write_the_same_bytes_and_plain_text_splits(corpus, tmp_path):
    preprocess(corpus, str(tmp_path / "one"), "byte", progress=False, split_sentences=True)
    preprocess(corpus, str(tmp_path / "two"), "byte", workers=2, progress=False, split_sentences=True)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    text = tmp_path / "lines.txt"
    text.write_text("One sentence. Two sentences!\nA single one\n", encoding="utf-8")
    preprocess(str(text), str(tmp_path / "t"), "byte", progress=False, split_sentences=True)
    ds = IndexedDataset(str(tmp_path / "t"))
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [bytes(ds[i].astype(np.uint8)).decode() for i in range(3)] == \
        ["One sentence.", "Two sentences!", "A single one"]


def test_missing_nltk_is_one_line_naming_the_install(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk", None)  # import nltk now raises ImportError
    with pytest.raises(DataError, match=r"needs NLTK.*pip install 'mtl-data\[sentences\]'"):
        preprocess(corpus, str(tmp_path / "x"), "byte", progress=False, split_sentences=True)
    assert not (tmp_path / "x.bin").exists()


def test_trained_punkt_parameters_are_used_where_nltk_data_is_installed(tmp_path, monkeypatch):
    import nltk
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    text = "Mr. Smith went home. He slept."
    untrained = build_sentence_splitter()
    assert "untrained" in untrained.description and untrained.split(text) == ["Mr.", "Smith went home.", "He slept."]
    # an installed punkt_tab model for english (here: one that knows the abbreviation "mr")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)] + nltk.data.path)
    params = PunktParameters()
    params.abbrev_types = {"mr"}
    model_dir = tmp_path / "tokenizers" / "punkt_tab" / "english"
    model_dir.mkdir(parents=True)
    save_punkt_params(params, dir=str(model_dir))
    trained = build_sentence_splitter()
    assert trained.description == "NLTK Punkt, trained (english)"
    assert trained.split(text) == ["Mr. Smith went home.", "He slept."]
