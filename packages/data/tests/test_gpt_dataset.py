import numpy as np
import pytest

from mtl.core.errors import DataError
from mtl.data.gpt_dataset import GPTDataset, build_gpt_indices
from mtl.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

megatron_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets import helpers as megatron_helpers  # noqa: E402


def megatron_indices(lengths, ids, seq_length, num_samples, seed):
    """Megatron-Core 0.16.1's own functions, called the way its GPTDataset calls them."""
    tokens = int(lengths[ids].sum())
    num_epochs, have = 1, tokens
    while num_samples is not None and have < num_samples * seq_length + 1:
        num_epochs, have = num_epochs + 1, have + tokens
    separate = False
    if num_epochs > 1:
        before = ((num_epochs - 1) * tokens - 1) // seq_length
        separate = num_samples - before < int(0.8 * ((tokens - 1) // seq_length))
    rng = np.random.RandomState(seed)
    doc = megatron_gpt._build_document_index(ids.astype(np.int32), num_epochs, rng, separate)
    sample = megatron_helpers.build_sample_idx(lengths.astype(np.int32), doc, seq_length,
                                               num_epochs, tokens, True, True)
    total = sample.shape[0] - 1
    shuffle = megatron_gpt._build_shuffle_index(before if separate else total, total, rng)
    return doc, sample, shuffle


@pytest.mark.parametrize("num_samples", [None, 7, 60, 95, 400])
def test_indices_equal_megatron_core(num_samples):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 50).astype(np.int32)
    lengths[[3, 17]] = 0  # empty documents are skipped by both
    ids = np.arange(5, 45)
    ours = build_gpt_indices(lengths, ids, 16, num_samples, seed=1234)
    theirs = megatron_indices(lengths, ids, 16, num_samples, 1234)
    for name, a, b in zip(("document", "sample", "shuffle"), ours, theirs):
        assert np.array_equal(a, b.astype(np.int64)), name
    if num_samples is not None:
        assert len(ours[2]) >= num_samples


def build_prefix(tmp_path, lengths):
    """Document k holds tokens 1000*k + 0, 1, 2, ... so any token names its document."""
    builder = IndexedDatasetBuilder(str(tmp_path / "docs.bin"), np.int32)
    docs = [1000 * k + np.arange(n) for k, n in enumerate(lengths)]
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(str(tmp_path / "docs.idx"))
    return IndexedDataset(str(tmp_path / "docs")), docs


def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path):
    indexed, docs = build_prefix(tmp_path, np.random.default_rng(1).integers(1, 40, 30))
    ds = GPTDataset(indexed, (4, 26), 8, 50, seed=5, cache_dir=str(tmp_path / "cache"))
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert set(np.unique(ds.document_index)) == set(range(4, 26))
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        sample = ds[i]
        window = stream[j * 8: j * 8 + 9]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
        assert str(sample["tokens"].dtype) == "torch.int64"
        assert str(sample["loss_mask"].dtype) == "torch.float32" and sample["loss_mask"].sum() == 8


def test_cache_is_reused_and_keyed_by_seed(tmp_path):
    indexed, _ = build_prefix(tmp_path, [30] * 20)
    cache = str(tmp_path / "cache")
    first = GPTDataset(indexed, (0, 20), 8, 40, seed=1, cache_dir=cache)
    again = GPTDataset(indexed, (0, 20), 8, 40, seed=1, cache_dir=cache)
    other_seed = GPTDataset(indexed, (0, 20), 8, 40, seed=2, cache_dir=cache)
    assert not first.loaded_from_cache and again.loaded_from_cache
    assert not other_seed.loaded_from_cache
    elsewhere = GPTDataset(indexed, (0, 20), 8, 40, seed=1, cache_dir=str(tmp_path / "c2"))
    for i in range(len(first)):
        assert first[i]["tokens"].tolist() == again[i]["tokens"].tolist() \
            == elsewhere[i]["tokens"].tolist()
    assert any(first[i]["tokens"].tolist() != other_seed[i]["tokens"].tolist()
               for i in range(len(first)))
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 6


def test_too_few_tokens_is_a_data_error(tmp_path):
    indexed, _ = build_prefix(tmp_path, [3, 3])
    with pytest.raises(DataError, match="fewer than one sample"):
        GPTDataset(indexed, (0, 2), 8, None, seed=1, cache_dir=str(tmp_path / "cache"))
