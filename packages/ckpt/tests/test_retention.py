"""prune_checkpoints: keep the newest N, never 'latest', delete by rename-then-remove."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtl.ckpt import ShardedTensor, directory, latest_iteration, load, prune_checkpoints, save
from mtl.ckpt.retention import DELETING_SUFFIX
from mtl.core.errors import CheckpointError

WRITER = Path(__file__).with_name("crash_writer.py")


def state_of(step: int) -> dict:
    return {"w": ShardedTensor("w", torch.full((3, 2), float(step)), (3, 2), (0, 0)), "step": step}


def assert_loads(ckpt_dir: str, step: int, iteration: int | None = None) -> None:
    template = {"w": ShardedTensor("w", torch.zeros(3, 2), (3, 2), (0, 0)), "step": -1}
    state, _ = load(template, ckpt_dir, iteration=iteration)
    assert state["step"] == step and torch.equal(state["w"].data, torch.full((3, 2), float(step)))


def saved(tmp_path, iterations) -> str:
    ckpt = str(tmp_path / "ckpt")
    for it in iterations:
        save(state_of(it), ckpt, it)
    return ckpt


def test_keeps_the_newest_n(tmp_path):
    ckpt = saved(tmp_path, [1, 2, 3, 4, 5])
    assert prune_checkpoints(ckpt, keep_last=2) == [1, 2, 3]
    assert directory.committed_iterations(ckpt) == [4, 5]
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000005", "latest"]
    assert_loads(ckpt, 5)
    assert_loads(ckpt, 4, iteration=4)
    assert prune_checkpoints(ckpt, keep_last=2) == []  # idempotent
    save(state_of(6), ckpt, 6)
    assert prune_checkpoints(ckpt, keep_last=2) == [4]


def test_keep_last_zero_keeps_everything(tmp_path):
    ckpt = saved(tmp_path, [1, 2, 3])
    assert prune_checkpoints(ckpt, keep_last=0) == []
    assert directory.committed_iterations(ckpt) == [1, 2, 3]


def test_latest_is_never_deleted_and_newer_iterations_are_left_alone(tmp_path):
    ckpt = saved(tmp_path, [1, 2, 3, 5, 6])
    directory.write_latest(ckpt, 3)  # a run rolled back to 3 (or killed before 'latest' named 5, 6)
    assert prune_checkpoints(ckpt, keep_last=1) == [1, 2]
    assert directory.committed_iterations(ckpt) == [3, 5, 6]
    assert latest_iteration(ckpt) == 3
    assert_loads(ckpt, 3)


def test_stale_partials_go_in_flight_ones_stay(tmp_path):
    ckpt = saved(tmp_path, [1, 2, 4])
    for it in (3, 5):  # 3: a save that crashed before 4 committed; 5: an async save in flight
        os.makedirs(os.path.join(directory.partial_dir(ckpt, it), "arrays"))
    assert prune_checkpoints(ckpt, keep_last=2) == [1]
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "iter_0000005.partial", "latest"]


def test_leftover_deleting_dirs_are_finished(tmp_path):
    ckpt = saved(tmp_path, [1, 2])
    os.rename(directory.iteration_dir(ckpt, 1), directory.iteration_dir(ckpt, 1) + DELETING_SUFFIX)
    assert directory.committed_iterations(ckpt) == [2]
    assert prune_checkpoints(ckpt, keep_last=5) == []  # nothing committed to drop, but the leftover goes
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest"]


def test_bad_arguments_and_untrustworthy_latest(tmp_path):
    ckpt = saved(tmp_path, [1, 2, 3])
    for bad in (-1, 1.5, True):
        with pytest.raises(CheckpointError, match="keep_last must be an int >= 0"):
            prune_checkpoints(ckpt, keep_last=bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        prune_checkpoints(str(tmp_path / "nope"), keep_last=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prune_checkpoints(str(empty), keep_last=1) == []

    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("garbage")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        prune_checkpoints(ckpt, keep_last=1)
    directory.write_latest(ckpt, 7)  # names an iteration that is not there
    with pytest.raises(CheckpointError, match="iteration 7 is not a committed checkpoint"):
        prune_checkpoints(ckpt, keep_last=1)
    os.remove(os.path.join(ckpt, "latest"))
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        prune_checkpoints(ckpt, keep_last=1)
    assert directory.committed_iterations(ckpt) == [1, 2, 3]  # nothing was deleted


@pytest.mark.parametrize("point", ["renamed_to_deleting", "half_deleted"])
def test_sigkill_during_pruning_leaves_latest_loadable(tmp_path, point):
    ckpt = saved(tmp_path, [1, 2, 3])
    proc = subprocess.run([sys.executable, str(WRITER), "prune", ckpt, "1", point],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"child exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert open(ckpt + ".killed").read().split()[0] == point

    doomed = directory.iteration_dir(ckpt, 1) + DELETING_SUFFIX
    assert os.path.isdir(doomed)  # the victim is out of the committed names before anything is removed
    if point == "half_deleted":
        # the arrays are gone but metadata.json is not: under the old name this would look committed
        assert sorted(os.listdir(doomed)) == ["metadata.json", "zarr.json"]
    assert directory.committed_iterations(ckpt) == [2, 3]
    assert latest_iteration(ckpt) == 3
    assert_loads(ckpt, 3)
    assert_loads(ckpt, 2, iteration=2)

    assert prune_checkpoints(ckpt, keep_last=1) == [2]  # the next prune finishes the job
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "latest"]
    assert_loads(ckpt, 3)
