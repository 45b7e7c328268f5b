"""Our .bin/.idx files against Megatron-Core 0.16.1's own reader and writer (CPU import)."""

import numpy as np
import pytest

from mtl.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

# Importing megatron.core needs no shim on CPU (it only warns that TE/Apex are absent).
megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def documents(seed, dtype):
    rng = np.random.default_rng(seed)
    high = 65000 if dtype == np.uint16 else 200000
    return [rng.integers(0, high, rng.integers(1, 50)) for _ in range(40)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_ours(tmp_path, dtype):
    docs = documents(0, dtype)
    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype)
    builder.add_document(docs[0].tolist(), lengths=[1, len(docs[0]) - 1])  # a two-sentence doc
    for doc in docs[1:]:
        builder.add_document(doc)
    builder.finalize(str(tmp_path / "ours.idx"))

    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    ours = IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(ours) == len(docs) + 1
    for i in range(len(ours)):
        assert np.array_equal(theirs[i], ours[i]) and theirs[i].dtype == dtype
    assert np.concatenate([theirs[0], theirs[1]]).tolist() == docs[0].tolist()
    assert np.array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    assert np.array_equal(theirs.get(5, 2, 3), ours.get(5, 2, 3))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_read_megatrons_and_write_the_same_bytes(tmp_path, dtype):
    docs = documents(1, dtype)
    theirs = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    ours = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype)
    for doc in docs:
        theirs.add_document(doc, [len(doc)])
        ours.add_document(doc)
    theirs.finalize(str(tmp_path / "theirs.idx"))
    ours.finalize(str(tmp_path / "ours.idx"))

    read = IndexedDataset(str(tmp_path / "theirs"))
    assert [read[i].tolist() for i in range(len(read))] == [d.tolist() for d in docs]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"theirs{suffix}").read_bytes() == (tmp_path / f"ours{suffix}").read_bytes()
