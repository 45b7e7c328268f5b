"""``mtl preprocess`` writes an indexed dataset that reads back as the tokenizer's ids;
``mtl plugins`` lists what is installed."""

import importlib.metadata
import re

import pytest

from mtl.data.indexed_dataset import IndexedDataset

TEXTS = ["hello world", "héllo wörld — ünïcode", "a third document,\nwith a newline", "x"]


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_byte_tokens_read_back(mtl, ok, workdir, jsonl, append_eod):
    jsonl(workdir / "corpus.jsonl", TEXTS)
    args = ["preprocess", "--input", "corpus.jsonl", "--output-prefix", "out/P", "--tokenizer", "byte"]
    out = ok(mtl(*args, *(["--append-eod"] if append_eod else [])))
    expected = [list(t.encode("utf-8")) + ([256] if append_eod else []) for t in TEXTS]
    assert f"{len(TEXTS)} docs, {sum(map(len, expected))} tokens" in out
    assert (workdir / "out" / "P.bin").is_file() and (workdir / "out" / "P.idx").is_file()
    dataset = IndexedDataset(str(workdir / "out" / "P"))
    assert len(dataset) == len(TEXTS)
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected


def test_preprocess_json_key_and_workers(mtl, ok, workdir):
    (workdir / "c.jsonl").write_text("".join(f'{{"body": "doc {i}"}}\n' for i in range(50)))
    ok(mtl("preprocess", "--input", "c.jsonl", "--output-prefix", "Q", "--json-key", "body", "--workers", "2"))
    dataset = IndexedDataset(str(workdir / "Q"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [list(f"doc {i}".encode()) for i in range(50)]


def test_preprocess_split_sentences_keeps_documents(mtl, ok, workdir, jsonl):
    pytest.importorskip("nltk")
    jsonl(workdir / "corpus.jsonl", ["First one. Second one!", "Alone"])
    out = ok(mtl("preprocess", "--input", "corpus.jsonl", "--output-prefix", "S", "--split-sentences"))
    assert "3 sentences split by NLTK Punkt" in out and "2 docs" in out
    dataset = IndexedDataset(str(workdir / "S"))
    assert dataset.document_indices.tolist() == [0, 2, 3]
    assert [bytes(dataset[i].tolist()).decode() for i in range(3)] == ["First one.", "Second one!", "Alone"]


def test_plugins_lists_distributions_versions_and_registrations(mtl, ok):
    out = ok(mtl("plugins"))
    blocks = {}
    for block in re.split(r"\n(?=\S)", out.strip()):
        head, *rest = block.splitlines()
        name, version = head.split()
        blocks[name] = (version, {k.strip(): v.split(", ") for k, v in (line.split(": ", 1) for line in rest)})
    for dist in ("mtl-core", "mtl-parallel", "mtl-models", "mtl-data", "mtl-ckpt", "mtl-train", "mtl-cli",
                 "mtl-example-plugin"):
        assert dist in blocks, out
        assert blocks[dist][0] == importlib.metadata.version(dist)
    assert "local" in blocks["mtl-parallel"][1]["backend"]
    assert "gpt" in blocks["mtl-models"][1]["model family"]
    assert {"byte", "hf"} <= set(blocks["mtl-data"][1]["tokenizer"])
    assert {"gpt", "mock"} <= set(blocks["mtl-data"][1]["dataset"])
    assert "eager" in blocks["mtl-example-plugin"][1]["backend"]
    assert "zarr" in blocks["mtl-ckpt"][1]["checkpoint format"]


def test_version_and_help(mtl, ok):
    assert importlib.metadata.version("mtl-cli") in ok(mtl("--version"))
    out = ok(mtl("--help"))
    for command in ("train", "preprocess", "generate", "convert", "plugins", "ckpt", "demo"):
        assert re.search(rf"^\s+{command}\s", out, re.MULTILINE), command


def test_preprocess_refuses_an_existing_prefix_unless_overwrite(mtl, ok, clean_error, workdir, jsonl):
    jsonl(workdir / "a.jsonl", ["first corpus"])
    jsonl(workdir / "b.jsonl", ["the second corpus"])
    ok(mtl("preprocess", "--input", "a.jsonl", "--output-prefix", "out/P"))
    out = clean_error(mtl("preprocess", "--input", "b.jsonl", "--output-prefix", "out/P"),
                      "out/P.bin", "out/P.idx", "--overwrite")
    assert len(out.strip().splitlines()) == 1
    assert IndexedDataset(str(workdir / "out" / "P"))[0].tolist() == list(b"first corpus")
    ok(mtl("preprocess", "--input", "b.jsonl", "--output-prefix", "out/P", "--overwrite"))
    assert IndexedDataset(str(workdir / "out" / "P"))[0].tolist() == list(b"the second corpus")
