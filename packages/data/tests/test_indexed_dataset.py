import struct

import numpy as np
import pytest

from mtl.core.errors import DataError
from mtl.data.indexed_dataset import (
    HEADER_SIZE, MAGIC, IndexedDataset, IndexedDatasetBuilder, optimal_dtype,
)


def random_documents(seed=0, count=25, vocab=60000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 40)).tolist() for _ in range(count)]


def write(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_round_trip_and_exact_layout(tmp_path):
    docs = random_documents()
    prefix = write(tmp_path / "d", docs)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.num_documents == len(docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc and ds[i].dtype == np.uint16 and type(ds[i]) is np.ndarray
    assert ds.get(3, 2, 4).tolist() == docs[3][2:6]
    assert [a.tolist() for a in ds[1:4]] == docs[1:4]
    lengths = [len(d) for d in docs]
    assert ds.sequence_lengths.tolist() == lengths
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    # the bytes on disk, field by field
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == MAGIC == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:HEADER_SIZE]) == (1, 8, len(docs), len(docs) + 1)
    body = np.frombuffer(raw, np.int32, len(docs), HEADER_SIZE)
    assert body.tolist() == lengths
    pointers = np.frombuffer(raw, np.int64, len(docs), HEADER_SIZE + 4 * len(docs))
    assert pointers.tolist() == (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2).tolist()
    assert (tmp_path / "d.bin").read_bytes() == np.concatenate(
        [np.asarray(d, np.uint16) for d in docs]).tobytes()


def test_bulk_add_and_multi_sequence_documents_match_single_adds(tmp_path):
    docs = random_documents(1)
    one_by_one = write(tmp_path / "a", docs, np.int32)
    bulk = IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.int32)
    bulk.add_documents(np.concatenate([np.asarray(d, np.int32) for d in docs]), [len(d) for d in docs])
    bulk.finalize(str(tmp_path / "b.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()
    split = IndexedDatasetBuilder(str(tmp_path / "c.bin"), np.int32)
    split.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
    split.add_document([6])
    split.finalize(str(tmp_path / "c.idx"))
    ds = IndexedDataset(str(tmp_path / "c"))
    assert [s.tolist() for s in ds[0:3]] == [[1, 2], [3, 4, 5], [6]]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert IndexedDataset(one_by_one).dtype == np.int32


def test_optimal_dtype_follows_megatron():
    assert optimal_dtype(50257) is np.uint16 and optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32 and optimal_dtype(128256) is np.int32


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(write(tmp_path / "e", []))
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


def test_bad_files_are_named(tmp_path):
    prefix = write(tmp_path / "d", random_documents())
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()

    idx.write_bytes(good_idx[:-8])
    with pytest.raises(DataError, match=r"d\.idx has .* bytes but its header promises"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx[:20])
    with pytest.raises(DataError, match=r"d\.idx is truncated"):
        IndexedDataset(prefix)
    idx.write_bytes(b"NOTMAGIC!" + good_idx[9:])
    with pytest.raises(DataError, match=r"d\.idx is not a Megatron \.idx file"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx)
    bin_.write_bytes(good_bin[:-2])
    with pytest.raises(DataError, match=r"d\.bin has .* bytes but"):
        IndexedDataset(prefix)
    bin_.unlink()
    with pytest.raises(DataError, match=r"d\.bin does not exist"):
        IndexedDataset(prefix)
    with pytest.raises(DataError, match=r"nothing\.idx does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_pickling_maps_the_files_again_instead_of_copying_tokens(tmp_path):
    import pickle

    docs = [list(range(5000))] * 4
    ds = IndexedDataset(write(tmp_path / "p", docs))
    payload = pickle.dumps(ds)
    assert len(payload) < 1000  # the 40 kB of tokens are not in it
    copy = pickle.loads(payload)
    assert [copy[i].tolist() for i in range(4)] == docs
