"""Crash safety under SIGKILL: a real child process dies at each point of a save and of its
commit (sync ``save`` and ``AsyncSaver``), and the directory it leaves must still load.

The kill points and the child live in ``crash_writer.py``; the parent only inspects what
is on disk afterwards, then resumes the way a restarted run would.
"""

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtl.ckpt import ShardedTensor, directory, latest_iteration, load, save
from mtl.core.errors import CheckpointError

WRITER = Path(__file__).with_name("crash_writer.py")
_spec = importlib.util.spec_from_file_location("crash_writer", WRITER)
crash_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_writer)
make_state = crash_writer.make_state

THREAD_POINTS = {"finish_write:1", "finish_write:3"}  # run on the AsyncSaver's writer thread
CASES = [("sync", point) for point in crash_writer.SAVE_POINTS] + [
    ("async", point) for point in ("create_array:2", "finish_write:1", "finish_write:3", "metadata_tmp", "renamed")
]


def run_child(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run crash_writer.py; returns the process and the (point, thread) it reported dying at."""
    proc = subprocess.run([sys.executable, str(WRITER), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"child exited {proc.returncode}, not by SIGKILL:\n{proc.stderr[-3000:]}"
    with open(args[1] + ".killed") as f:
        return proc, f.read().split()


def template() -> dict:
    zeros = make_state(0)
    for shard in zeros["model"].values():
        shard.data.zero_()
    zeros["step"], zeros["note"] = -1, ""
    return zeros


def assert_killed_where_claimed(ckpt_dir: str, point: str) -> None:
    """What the killed save left on disk shows it died at ``point`` and not elsewhere."""
    partial = directory.partial_dir(ckpt_dir, 2)
    name, _, count = point.partition(":")
    if name == "create_array":
        arrays = os.listdir(os.path.join(partial, directory.ARRAYS_DIR))
        assert len([a for a in arrays if a != "zarr.json"]) == int(count)
    elif name == "finish_write":
        # chunk files live under arrays/<key>/c/ (zarr v3 default chunk keys)
        chunks = [os.path.join(here, n) for here, _, names in os.walk(partial) for n in names
                  if f"{os.sep}c{os.sep}" in os.path.join(here, n)]
        # every shard's write is started at once, so after the k-th is on disk later ones may
        # be too (or half-written, with tensorstore's lock file beside them)
        chunks = [c for c in chunks if not c.endswith(".__lock")]
        assert len(chunks) >= int(count), chunks
    elif point == "metadata_tmp":
        assert sorted(os.listdir(partial)) == ["arrays", "metadata.json.tmp", "zarr.json"]
    elif point == "metadata_replaced":
        assert sorted(os.listdir(partial)) == ["arrays", "metadata.json", "zarr.json"]
    leftover_latest = [n for n in os.listdir(ckpt_dir) if n.startswith(f".{directory.LATEST_FILE}.tmp")]
    assert len(leftover_latest) == (1 if point == "latest_tmp" else 0)


def assert_loads_exactly(ckpt_dir: str, iteration: int | None, step: int) -> None:
    """``iteration`` (None: latest) loads with verification and holds ``make_state(step)``."""
    state, metadata = load(template(), ckpt_dir, iteration=iteration, verify=True)
    expected = make_state(step)
    assert metadata == {"iteration": step}
    assert state["step"] == step and state["note"] == expected["note"]
    for name, shard in expected["model"].items():
        got = state["model"][name].data
        assert got.dtype == shard.data.dtype and torch.equal(got, shard.data), name


@pytest.mark.parametrize(("mode", "point"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_sigkill_during_save_leaves_latest_loadable(tmp_path, mode, point):
    ckpt = str(tmp_path / "ckpt")
    _, (reached, thread) = run_child("save", ckpt, mode, point)
    assert reached == point
    if mode == "async" and point in THREAD_POINTS:
        assert thread.startswith("mtl-ckpt-save-"), thread  # killed from the writer thread
    else:
        assert thread == "MainThread"
    assert_killed_where_claimed(ckpt, point)

    committed_2 = point in crash_writer.COMMITTED_POINTS
    latest = 2 if point == "latest_replaced" else 1
    assert latest_iteration(ckpt) == latest
    assert directory.committed_iterations(ckpt) == ([1, 2] if committed_2 else [1])
    assert_loads_exactly(ckpt, None, latest)
    if committed_2:  # the renamed directory is complete even when 'latest' never named it
        assert_loads_exactly(ckpt, 2, 2)
    else:
        assert os.path.isdir(directory.partial_dir(ckpt, 2))  # the remains of the killed save
        with pytest.raises(CheckpointError, match="iteration 2 is not a committed checkpoint"):
            load(template(), ckpt, iteration=2)

    # a restarted run resumes from 'latest' and saves the next iteration into the same directory
    resume_at = latest + 1
    # A kill between the rename and the update of 'latest' leaves a complete iter_2 that
    # 'latest' does not name: the resumed run's save of 2 replaces it.
    save(make_state(resume_at), ckpt, resume_at, {"iteration": resume_at})
    assert latest_iteration(ckpt) == resume_at
    assert_loads_exactly(ckpt, None, resume_at)
    assert not [name for name in os.listdir(ckpt) if name.endswith(".partial")]


@pytest.mark.parametrize("point", ["finish_write:1", "renamed"])
def test_sigkill_during_the_first_save(tmp_path, point):
    """No earlier checkpoint to fall back to: before the rename the directory is as if never
    saved to; after it, iteration 1 is complete but only reachable by number. Either way a
fresh save of iteration 1 commits."""
    ckpt = str(tmp_path / "ckpt")
    _, (reached, _) = run_child("save", ckpt, "first", point)
    assert reached == point
    if point == "renamed":
        # With no 'latest' a resume by latest fails (the message names iteration 1), and a
        # run starting afresh replaces iteration 1 when it saves it.
        with pytest.raises(CheckpointError, match=r"no 'latest' file \(committed iterations found: \[1\]; pass iteration=N"):
            latest_iteration(ckpt)
        assert_loads_exactly(ckpt, 1, 1)
    else:
        with pytest.raises(CheckpointError, match="no checkpoint was ever committed here"):
            latest_iteration(ckpt)
    save(make_state(1), ckpt, 1, {"iteration": 1})
    assert latest_iteration(ckpt) == 1 and not os.path.exists(directory.partial_dir(ckpt, 1))
    assert_loads_exactly(ckpt, None, 1)


def chunk_files(ckpt_dir: str, iteration: int, key: str) -> list[str]:
    root = os.path.join(directory.iteration_dir(ckpt_dir, iteration), directory.ARRAYS_DIR, key, "c")
    return sorted(os.path.join(here, name) for here, _, names in os.walk(root) for name in names)


def test_flipped_bytes_in_latest_are_caught_and_the_previous_iteration_still_loads(tmp_path):
    """Silent corruption (same length, valid zarr) of one tensor of the newest checkpoint:
    verify names the tensor, verify=False cannot see it, and the advice of the error — load
    another iteration — works."""
    ckpt = str(tmp_path)
    save(make_state(1), ckpt, 1, {"iteration": 1})
    save(make_state(2), ckpt, 2, {"iteration": 2})
    (path,) = chunk_files(ckpt, 2, "model.norm")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x5A
    open(path, "wb").write(bytes(raw))

    with pytest.raises(CheckpointError, match=r"tensor 'model.norm' shard at offset \[0\] shape \[5\] fails its checksum"):
        load(template(), ckpt, verify=True)
    unverified, _ = load(template(), ckpt, verify=False)  # same bytes count, so nothing else notices
    assert not torch.equal(unverified["model"]["norm"].data, make_state(2)["model"]["norm"].data)
    assert torch.equal(unverified["model"]["w"].data, make_state(2)["model"]["w"].data)
    assert_loads_exactly(ckpt, 1, 1)
