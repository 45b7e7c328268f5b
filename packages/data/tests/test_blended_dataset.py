import numpy as np
import pytest

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError, DataError
from mtl.core.plugins import registry
from mtl.data.blended_dataset import (
    BlendedDataset, build_blending_indices, parse_data_paths, parse_split, split_document_ranges,
)
from mtl.data.indexed_dataset import IndexedDatasetBuilder

megatron_helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
megatron_config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")


def test_data_paths_forms_and_errors():
    assert parse_data_paths(["a"]) == [(1.0, "a")]
    assert parse_data_paths([[7, "a"], [3, "b"]]) == [(0.7, "a"), (0.3, "b")]
    for bad, message in [([], "data.paths is empty"), ([[0.5, 3]], "neither a prefix"),
                         (["a", "b"], "needs a weight"), ([[0, "a"], [1, "b"]], "positive")]:
        with pytest.raises(ConfigError, match=message):
            parse_data_paths(bad)


@pytest.mark.parametrize("split", ["98,1,1", "90,10", "1,1,1", "969,30,1"])
@pytest.mark.parametrize("num_documents", [7, 100, 1001])
def test_split_ranges_match_megatron_core(split, num_documents):
    shares = parse_split(split)
    assert shares == pytest.approx(megatron_config.parse_and_normalize_split(split))
    matrix = megatron_config.convert_split_vector_to_split_matrix(shares)
    expected = [(int(round(b * num_documents)), int(round(e * num_documents))) if b is not None
                else (0, 0) for b, e in [m if m is not None else (None, None) for m in matrix]]
    ranges = split_document_ranges(num_documents, shares)
    assert [r for r, m in zip(ranges, matrix) if m is not None] == \
        [e for e, m in zip(expected, matrix) if m is not None]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_documents
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ConfigError, match="data.split"):
        parse_split("a,b")


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.2, 0.3], [0.05, 0.9, 0.05]])
def test_blending_indices_equal_megatron_core_and_track_weights(weights):
    weights = np.asarray(weights)
    size = 2000
    ours = build_blending_indices(weights, size)
    theirs = (np.zeros(size, np.int16), np.zeros(size, np.int64))
    megatron_helpers.build_blending_indices(theirs[0], theirs[1], weights, len(weights), size, False)
    assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    # at every prefix of the stream the realised counts stay close to the target (the first
    # two draws both aim at weight * 1, Megatron's max(i, 1), hence slightly over one sample)
    counts = np.cumsum(np.eye(len(weights))[ours[0]], axis=0)  # [size, datasets]
    n = np.arange(1, size + 1)[:, None]
    assert np.abs(counts - weights * n).max() <= 1.5
    assert np.abs(counts[-1] - weights * size).max() <= 1.0


def write_prefix(path, first_doc_id, num_docs=60, doc_length=20):
    """Document k holds only the id first_doc_id + k, so a token names its source document."""
    builder = IndexedDatasetBuilder(str(path) + ".bin", np.int32)
    for k in range(num_docs):
        builder.add_document(np.full(doc_length, first_doc_id + k))
    builder.finalize(str(path) + ".idx")
    return str(path)


def config_for(paths, tmp_path, split="80,10,10", seed=3):
    config = RunConfig()
    config.data.paths, config.data.split = paths, split
    config.data.cache_dir = str(tmp_path / "cache")
    config.model.seq_length, config.train.seed = 16, seed
    return config.resolve(world_size=1, tokenizer_vocab_size=257)


def test_registered_gpt_dataset_blends_and_splits(tmp_path):
    a = write_prefix(tmp_path / "a", 0)
    b = write_prefix(tmp_path / "b", 1000)
    config = config_for([[0.7, a], [0.3, b]], tmp_path)
    build = registry("dataset").get("gpt").build
    tokenizer = registry("tokenizer").get("byte").build(None)
    train = build(config, tokenizer, "train", 500)
    assert isinstance(train, BlendedDataset) and len(train) == 500
    sources = np.asarray([int(train[i]["tokens"][0] >= 1000) for i in range(500)])
    assert abs(np.mean(sources == 0) - 0.7) <= 1 / 500
    documents_seen = {"train": set(), "valid": set(), "test": set()}
    for split in documents_seen:
        # enough samples that every document of the split is read at least once
        ds = train if split == "train" else build(config, tokenizer, split, 60)
        for i in range(len(ds)):
            documents_seen[split] |= set(ds[i]["tokens"].tolist()) | set(ds[i]["labels"].tolist())
    # 60 documents split 80/10/10 -> 48/6/6 per prefix
    assert documents_seen["train"] == set(range(48)) | set(range(1000, 1048))
    assert documents_seen["valid"] == set(range(48, 54)) | set(range(1048, 1054))
    assert documents_seen["test"] == set(range(54, 60)) | set(range(1054, 1060))
    # same seed -> same samples, another seed -> another order
    again = build(config, tokenizer, "train", 500)
    other = build(config_for([[0.7, a], [0.3, b]], tmp_path, seed=4), tokenizer, "train", 500)
    assert all(train[i]["tokens"].tolist() == again[i]["tokens"].tolist() for i in range(500))
    assert any(train[i]["tokens"].tolist() != other[i]["tokens"].tolist() for i in range(50))


def test_single_prefix_and_empty_split(tmp_path):
    a = write_prefix(tmp_path / "a", 0, num_docs=20)
    build = registry("dataset").get("gpt").build
    tokenizer = registry("tokenizer").get("byte").build(None)
    one_epoch = build(config_for([a], tmp_path, split="100,0,0"), tokenizer, "train")
    assert len(one_epoch) == (20 * 20 - 1) // 16
    with pytest.raises(DataError, match="leaves the valid split no documents"):
        build(config_for([a], tmp_path, split="100,0,0"), tokenizer, "valid", 10)
