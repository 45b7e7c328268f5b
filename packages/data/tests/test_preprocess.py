import json

import numpy as np
import pytest

from mtl.core.errors import DataError
from mtl.core.plugins import registry
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.indexed_dataset import IndexedDataset
from mtl.data.preprocess import preprocess


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_demo_corpus(str(tmp_path_factory.mktemp("corpus") / "demo.jsonl"), num_docs=300, seed=3)


def texts_of(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_jsonl_with_gpt2_bpe_matches_direct_encoding(corpus, bpe_dir, tmp_path):
    stats = preprocess(corpus, str(tmp_path / "out" / "demo"), "gpt2-bpe", str(bpe_dir),
                       append_eod=True, progress=False)
    tokenizer = registry("tokenizer").get("gpt2-bpe").build(str(bpe_dir))
    expected = [tokenizer.encode(t) + [tokenizer.eod] for t in texts_of(corpus)]
    ds = IndexedDataset(str(tmp_path / "out" / "demo"))
    assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == 300
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert (stats.docs, stats.tokens) == (300, sum(map(len, expected)))
    assert stats.seconds > 0 and stats.docs_per_s > 0 and stats.mb_per_s > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["demo.bin", "demo.idx"]


def test_two_workers_write_the_same_bytes_as_one(corpus, tmp_path):
    preprocess(corpus, str(tmp_path / "one"), "byte", progress=False)
    preprocess(corpus, str(tmp_path / "two"), "byte", workers=2, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "one"))
    assert [ds[i].tobytes() for i in range(3)] == \
        [np.frombuffer(t.encode(), np.uint8).astype(np.uint16).tobytes() for t in texts_of(corpus)[:3]]


def test_plain_text_one_document_per_line(tmp_path):
    source = tmp_path / "lines.txt"
    source.write_text("first document\n\nsecond one, after a blank line\nthird\n", encoding="utf-8")
    stats = preprocess(str(source), str(tmp_path / "t"), "byte", append_eod=True, progress=False)
    ds = IndexedDataset(str(tmp_path / "t"))
    assert stats.docs == 3
    assert [bytes(ds[i][:-1].astype(np.uint8)).decode() for i in range(3)] == \
        ["first document", "second one, after a blank line", "third"]
    assert all(ds[i][-1] == 256 for i in range(3))


def test_bad_json_line_names_file_and_line_and_leaves_nothing(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: not valid JSON"):
        preprocess(str(source), str(tmp_path / "out"), "byte", progress=False)
    assert list(tmp_path.iterdir()) == [source]


def test_plain_text_that_is_not_utf8_names_the_line(tmp_path):
    source = tmp_path / "latin1.txt"
    source.write_bytes("fine\n".encode() + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt line 2: not UTF-8"):
        preprocess(str(source), str(tmp_path / "out"), "byte", progress=False)


def test_missing_key_names_the_key_and_the_keys_present(tmp_path):
    source = tmp_path / "keys.jsonl"
    source.write_text('{"content": "x", "id": 1}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 1: no key 'text' \(present: 'content', 'id'\)"):
        preprocess(str(source), str(tmp_path / "out"), "byte", workers=2, progress=False)
    assert list(tmp_path.iterdir()) == [source]


def test_missing_input_and_tokenizer_model(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl does not exist"):
        preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "out"), "byte")
    source = tmp_path / "a.jsonl"
    source.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="set data.tokenizer_model"):
        preprocess(str(source), str(tmp_path / "out"), "gpt2-bpe")


def test_an_existing_output_is_refused_before_tokenizing_unless_overwrite(tmp_path):
    source = tmp_path / "c.jsonl"
    source.write_text('{"text": "first"}\n', encoding="utf-8")
    preprocess(str(source), str(tmp_path / "out"), "byte", progress=False)
    before = (tmp_path / "out.bin").read_bytes()
    source.write_text('{"text": "second corpus"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"out\.bin, .*out\.idx: pass --overwrite"):
        preprocess(str(source), str(tmp_path / "out"), "byte", progress=False, overwrite=False)
    assert (tmp_path / "out.bin").read_bytes() == before
    stats = preprocess(str(source), str(tmp_path / "out"), "byte", progress=False, overwrite=True)
    assert stats.tokens == len("second corpus") and (tmp_path / "out.bin").read_bytes() != before
