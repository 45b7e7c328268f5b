"""Every load error names what is wrong and where."""

import os

import pytest
import torch

from mtl.ckpt import ShardedTensor, latest_iteration, list_keys, load, read_metadata, save
from mtl.core.errors import CheckpointError


@pytest.fixture()
def ckpt(tmp_path):
    state = {f"layer{i}.w": ShardedTensor(f"layer{i}.w", torch.arange(12.0).reshape(4, 3) + i, (4, 3), (0, 0)) for i in range(3)}
    save(state, str(tmp_path), 4, {"k": 1})
    return str(tmp_path)


def tmpl(key="layer0.w", shape=(4, 3)):
    return {"x": ShardedTensor(key, torch.zeros(shape), shape, (0,) * len(shape))}


def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=f"{missing} does not exist"):
        load(tmpl(), missing)
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_iteration(missing)


def test_no_latest_and_no_iteration(tmp_path_factory, ckpt):
    empty = str(tmp_path_factory.mktemp("empty"))
    with pytest.raises(CheckpointError, match="no 'latest' file.*no checkpoint was ever committed"):
        load(tmpl(), empty)
    os.remove(os.path.join(ckpt, "latest"))
    with pytest.raises(CheckpointError, match=r"no 'latest' file.*committed iterations found: \[4\]; pass iteration=N"):
        load(tmpl(), ckpt)
    load(tmpl(), ckpt, iteration=4)  # an explicit iteration still works
    with pytest.raises(CheckpointError, match="iteration 9 is not a committed checkpoint"):
        read_metadata(ckpt, 9)


def test_garbled_latest(ckpt):
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("banana")
    with pytest.raises(CheckpointError, match="latest should hold an iteration number but holds 'banana'"):
        latest_iteration(ckpt)


def test_missing_key_lists_present_keys(ckpt):
    with pytest.raises(CheckpointError, match=r"'decoder.w' .* is not in .*iter_0000004.*3 tensors, e.g. \['layer0.w', 'layer1.w'"):
        load(tmpl("decoder.w"), ckpt)
    assert list_keys(ckpt) == ["layer0.w", "layer1.w", "layer2.w"]


def test_global_shape_mismatch_names_both_shapes(ckpt):
    with pytest.raises(CheckpointError, match=r"'layer1.w' has global shape \(4, 3\) .* asks for \(4, 5\): a checkpoint from a different model shape"):
        load(tmpl("layer1.w", (4, 5)), ckpt)


def chunk_file(ckpt, key):
    return os.path.join(ckpt, "iter_0000004", "arrays", key, "c", "0", "0")


def test_corrupt_chunk_fails_checksum(ckpt):
    path = chunk_file(ckpt, "layer2.w")
    raw = bytearray(open(path, "rb").read())
    raw[5] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=r"'layer2.w' shard at offset \[0, 0\] shape \[4, 3\] fails its checksum"):
        load(tmpl("layer2.w"), ckpt)
    load(tmpl("layer1.w"), ckpt)  # the other tensors are intact


def test_missing_chunk_fails_checksum(ckpt):
    os.remove(chunk_file(ckpt, "layer1.w"))
    with pytest.raises(CheckpointError, match="'layer1.w'.*fails its checksum"):
        load(tmpl("layer1.w"), ckpt)


def test_missing_array_metadata(ckpt):
    os.remove(os.path.join(ckpt, "iter_0000004", "arrays", "layer0.w", "zarr.json"))
    with pytest.raises(CheckpointError, match="array for tensor 'layer0.w' at .*layer0.w cannot be opened"):
        load(tmpl("layer0.w"), ckpt)


def test_truncated_chunk_is_an_error(ckpt):
    path = chunk_file(ckpt, "layer0.w")
    open(path, "wb").write(open(path, "rb").read()[:7])
    with pytest.raises(CheckpointError, match="'layer0.w'"):
        load(tmpl("layer0.w"), ckpt)


def test_corrupt_metadata_json(ckpt):
    with open(os.path.join(ckpt, "iter_0000004", "metadata.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="metadata.json is unreadable"):
        load(tmpl(), ckpt)


def test_metadata_must_be_json(tmp_path):
    with pytest.raises(CheckpointError, match="metadata is not JSON-able"):
        save(tmpl(), str(tmp_path), 1, {"obj": object()})
    with pytest.raises(CheckpointError, match="iteration must be an int >= 0"):
        save(tmpl(), str(tmp_path), -1)


def test_strict_common_state_missing(ckpt):
    with pytest.raises(CheckpointError, match="common state entry 'step' is not in the checkpoint"):
        load({**tmpl(), "step": 0}, ckpt)


def test_unsupported_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="complex64 cannot be checkpointed"):
        save({"c": ShardedTensor("c", torch.zeros(2, dtype=torch.complex64), (2,), (0,))}, str(tmp_path), 1)
