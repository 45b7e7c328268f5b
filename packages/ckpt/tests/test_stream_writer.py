"""StreamingCheckpointWriter: written a tensor at a time, loaded by ``load`` (verified) at any slicing."""

import json
import os

import pytest
import torch

from mtl.ckpt import ShardedTensor, latest_iteration, load, read_metadata
from mtl.ckpt.stream_writer import StreamingCheckpointWriter
from mtl.core.errors import CheckpointError


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embedding": torch.randn(100, 8, generator=g),  # chunked past its end: (64, 8)
        "model.fc1": torch.randn(2, 12, 8, generator=g).to(torch.bfloat16),
        "model.norm": torch.randn(8, generator=g),
        "step": torch.tensor(3),
    }


CHUNKS = {"model.embedding": (64, 8), "model.fc1": (2, 6, 8), "model.norm": None, "step": None}


def write_all(ckpt_dir, metadata=None):
    writer = StreamingCheckpointWriter(str(ckpt_dir), 0, metadata or {"note": "converted"})
    for key, tensor in tensors().items():
        writer.write(key, tensor, CHUNKS[key])
    return writer.commit()


def test_loads_with_verification_whole_and_in_slices(tmp_path):
    committed = write_all(tmp_path)
    assert committed.endswith("iter_0000000") and latest_iteration(str(tmp_path)) == 0
    assert read_metadata(str(tmp_path)) == {"note": "converted"}
    expected = tensors()
    template = {k: ShardedTensor(k, torch.zeros_like(v), tuple(v.shape), (0,) * v.dim()) for k, v in expected.items()}
    state, _ = load(template, str(tmp_path), verify=True)
    for key, tensor in expected.items():
        assert state[key].data.dtype == tensor.dtype and torch.equal(state[key].data, tensor), key
    # a tp=2 rank's half of fc1 ([2, 6, 8] at offset 6 on dim 1): one chunk, one shard read
    half = ShardedTensor("model.fc1", torch.zeros(2, 6, 8, dtype=torch.bfloat16), (2, 12, 8), (0, 6, 0))
    load({"model.fc1": half}, str(tmp_path), verify=True)
    assert torch.equal(half.data, expected["model.fc1"][:, 6:])
    manifest = json.load(open(os.path.join(committed, "metadata.json")))
    entry = manifest["tensors"]["model.embedding"]
    assert entry["chunk_shape"] == [64, 8]
    assert [s["shape"] for s in entry["shards"]] == [[64, 8], [36, 8]]


def test_corruption_is_detected(tmp_path):
    committed = write_all(tmp_path)
    path = os.path.join(committed, "metadata.json")
    manifest = json.load(open(path))
    manifest["tensors"]["model.norm"]["shards"][0]["sha256"] = "0" * 64
    json.dump(manifest, open(path, "w"))
    norm = ShardedTensor("model.norm", torch.zeros(8), (8,), (0,))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load({"model.norm": norm}, str(tmp_path), verify=True)


def test_nothing_is_visible_before_commit_and_misuse_is_named(tmp_path):
    writer = StreamingCheckpointWriter(str(tmp_path), 5)
    writer.write("a", torch.ones(3))
    assert not (tmp_path / "latest").exists() and (tmp_path / "iter_0000005.partial").is_dir()
    with pytest.raises(CheckpointError, match="already written"):
        writer.write("a", torch.ones(3))
    with pytest.raises(CheckpointError, match="does not fit shape"):
        writer.write("b", torch.ones(3, 2), chunk_shape=(3,))
    writer.commit()
    with pytest.raises(CheckpointError, match="after commit"):
        writer.write("c", torch.ones(1))
    with pytest.raises(CheckpointError, match="already committed"):
        StreamingCheckpointWriter(str(tmp_path), 5)
