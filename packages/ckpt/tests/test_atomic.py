"""Atomic commit: a save that fails at any point leaves the previous checkpoint loadable."""

import os

import pytest
import torch

from mtl.ckpt import ShardedTensor, directory, latest_iteration, load, save, storage
from mtl.core.errors import CheckpointError


def state_of(value: float) -> dict:
    return {"w": ShardedTensor("w", torch.full((4, 3), value), (4, 3), (0, 0)),
            "b": ShardedTensor("b", torch.full((3,), value), (3,), (0,)), "step": int(value)}


def template() -> dict:
    return {"w": ShardedTensor("w", torch.zeros(4, 3), (4, 3), (0, 0)),
            "b": ShardedTensor("b", torch.zeros(3), (3,), (0,)), "step": -1}


def assert_loads_iteration_one(ckpt_dir: str) -> None:
    assert latest_iteration(ckpt_dir) == 1
    state, _ = load(template(), ckpt_dir)
    assert state["step"] == 1 and torch.equal(state["w"].data, torch.full((4, 3), 1.0))


def test_failure_mid_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    save(state_of(1.0), ckpt, 1)
    calls = []
    real_write = storage.start_write

    def write_then_crash(array, offset, data):
        calls.append(offset)
        if len(calls) == 2:  # the first array is on disk, the second never arrives
            raise OSError("injected crash mid-save")
        return real_write(array, offset, data)

    monkeypatch.setattr(storage, "start_write", write_then_crash)
    with pytest.raises(CheckpointError, match="rank 0: OSError: injected crash mid-save.*previous checkpoint is untouched"):
        save(state_of(2.0), ckpt, 2)
    assert os.path.isdir(os.path.join(ckpt, "iter_0000002.partial"))
    assert directory.committed_iterations(ckpt) == [1]
    assert_loads_iteration_one(ckpt)
    with pytest.raises(CheckpointError, match="iteration 2 is not a committed checkpoint.*committed: \\[1\\].*partial"):
        load(template(), ckpt, iteration=2)


def test_failure_after_metadata_before_rename(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    save(state_of(1.0), ckpt, 1)

    def crash(*args):
        raise OSError("injected crash before rename")

    monkeypatch.setattr(directory.os, "rename", crash)
    with pytest.raises(CheckpointError, match="committing iteration 2.*injected crash before rename"):
        save(state_of(2.0), ckpt, 2)
    monkeypatch.undo()
    # the partial directory is complete (metadata.json written) yet still ignored
    assert os.path.isfile(os.path.join(ckpt, "iter_0000002.partial", "metadata.json"))
    assert_loads_iteration_one(ckpt)
    # retrying the same iteration clears the stale partial and commits
    save(state_of(2.0), ckpt, 2)
    assert latest_iteration(ckpt) == 2 and not os.path.exists(os.path.join(ckpt, "iter_0000002.partial"))


def test_crash_between_rename_and_latest_keeps_previous_latest(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    save(state_of(1.0), ckpt, 1)
    monkeypatch.setattr(directory, "write_latest", lambda *a: (_ for _ in ()).throw(OSError("injected")))
    with pytest.raises(CheckpointError):
        save(state_of(2.0), ckpt, 2)
    monkeypatch.undo()
    assert_loads_iteration_one(ckpt)
    state, _ = load(template(), ckpt, iteration=2)  # the renamed directory is complete
    assert state["step"] == 2


def test_latest_is_replaced_not_rewritten(tmp_path):
    ckpt = str(tmp_path)
    save(state_of(1.0), ckpt, 1)
    inode_before = os.stat(os.path.join(ckpt, "latest")).st_ino
    save(state_of(3.0), ckpt, 3)
    assert open(os.path.join(ckpt, "latest")).read() == "3\n"
    assert os.stat(os.path.join(ckpt, "latest")).st_ino != inode_before
    assert not [n for n in os.listdir(ckpt) if n.startswith(".latest")]


def test_saving_a_committed_iteration_again_is_refused(tmp_path):
    ckpt = str(tmp_path)
    save(state_of(1.0), ckpt, 1)
    with pytest.raises(CheckpointError, match="iteration 1 is already committed"):
        save(state_of(5.0), ckpt, 1)
    assert_loads_iteration_one(ckpt)
