"""A child process that checkpoints and then dies by SIGKILL at a chosen point.

    python crash_writer.py save  CKPT_DIR sync|async POINT   # commits iteration 1, dies saving 2
    python crash_writer.py save  CKPT_DIR first POINT        # dies saving iteration 1, the first
    python crash_writer.py prune CKPT_DIR KEEP_LAST POINT    # dies inside prune_checkpoints

The kill is injected by monkeypatching mtl.ckpt (and ``os``) here, in the child only: the
library has no test hooks. Just before dying the child writes ``CKPT_DIR.killed`` holding
the point and the name of the thread it died on, so the parent knows the point was reached
(and that an async kill came from the writer thread). If the point is never reached the
child exits 3.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from typing import Callable

import torch

from mtl.ckpt import AsyncSaver, ShardedTensor, directory, retention, save, storage

# Kill points of a save, in the order a save reaches them. "create_array:2" and the commit
# points run on the caller's thread; "finish_write:k" (after the k-th shard reached disk)
# runs on the writer thread of an AsyncSaver.
SAVE_POINTS = [
    "create_array:2",  # iter_2.partial exists with two of three empty arrays
    "finish_write:1",  # one shard of iteration 2 on disk
    "finish_write:3",  # every shard on disk, no metadata.json yet
    "metadata_tmp",  # metadata.json.tmp written, not yet replaced
    "metadata_replaced",  # metadata.json in iter_2.partial, not yet renamed
    "renamed",  # iter_2.partial renamed to iter_2, 'latest' still names 1
    "latest_tmp",  # the new 'latest' temp file written and fsynced, not yet replaced
    "latest_replaced",  # 'latest' names 2 (before the directory fsync)
]
COMMITTED_POINTS = {"renamed", "latest_tmp", "latest_replaced"}  # iter_2 is a committed dir
PRUNE_POINTS = [
    "renamed_to_deleting",  # the first victim is iter_N.deleting, nothing removed yet
    "half_deleted",  # the first victim's arrays are gone, its metadata.json is still there
]


def make_state(step: int) -> dict:
    """A small state dict whose every value is determined by ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": ShardedTensor("model.w", torch.randn(6, 4, generator=g), (6, 4), (0, 0)),
            "norm": ShardedTensor("model.norm", torch.randn(5, generator=g).to(torch.bfloat16), (5,), (0,)),
            "ids": ShardedTensor("model.ids", torch.randint(-100, 100, (3, 2), generator=g), (3, 2), (0, 0)),
        },
        "step": step,
        "note": f"state of step {step}",
    }


def die(ckpt_dir: str, point: str) -> None:
    with open(ckpt_dir + ".killed", "w") as f:
        f.write(f"{point} {threading.current_thread().name}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _after_nth(ckpt_dir: str, point: str, real: Callable, n: int) -> Callable:
    calls = []

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            die(ckpt_dir, point)
        return result

    return wrapper


def _around_replace(ckpt_dir: str, point: str, target: str, before: bool) -> None:
    """Die at the ``os.replace`` whose destination is named ``target``, before or after it."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        hit = os.path.basename(dst) == target
        if hit and before:
            die(ckpt_dir, point)
        real(src, dst, *args, **kwargs)
        if hit:
            die(ckpt_dir, point)

    os.replace = replace


def install_save_point(ckpt_dir: str, point: str) -> None:
    name, _, count = point.partition(":")
    if name in ("create_array", "finish_write"):
        setattr(storage, name, _after_nth(ckpt_dir, point, getattr(storage, name), int(count)))
    elif point in ("metadata_tmp", "metadata_replaced"):
        _around_replace(ckpt_dir, point, directory.METADATA_FILE, before=point == "metadata_tmp")
    elif point in ("latest_tmp", "latest_replaced"):
        _around_replace(ckpt_dir, point, directory.LATEST_FILE, before=point == "latest_tmp")
    elif point == "renamed":
        real = os.rename

        def rename(src, dst, *args, **kwargs):
            real(src, dst, *args, **kwargs)
            if str(src).endswith(".partial"):
                die(ckpt_dir, point)

        os.rename = rename
    else:
        raise SystemExit(f"unknown save kill point {point!r}; known: {SAVE_POINTS}")


def install_prune_point(ckpt_dir: str, point: str) -> None:
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if str(path).endswith(".deleting"):
            if point == "half_deleted":
                real(os.path.join(path, directory.ARRAYS_DIR))
            die(ckpt_dir, point)
        real(path, *args, **kwargs)

    if point not in PRUNE_POINTS:
        raise SystemExit(f"unknown prune kill point {point!r}; known: {PRUNE_POINTS}")
    shutil.rmtree = rmtree


def run_save(ckpt_dir: str, mode: str, point: str) -> None:
    if mode == "first":
        install_save_point(ckpt_dir, point)
        save(make_state(1), ckpt_dir, 1, {"iteration": 1})
    elif mode == "sync":
        save(make_state(1), ckpt_dir, 1, {"iteration": 1})
        install_save_point(ckpt_dir, point)
        save(make_state(2), ckpt_dir, 2, {"iteration": 2})
    elif mode == "async":
        saver = AsyncSaver()
        saver.save(make_state(1), ckpt_dir, 1, {"iteration": 1})
        saver.wait()
        install_save_point(ckpt_dir, point)
        saver.save(make_state(2), ckpt_dir, 2, {"iteration": 2})
        saver.wait()
    else:
        raise SystemExit(f"unknown mode {mode!r}: sync, async or first")


def main(argv: list[str]) -> int:
    command, ckpt_dir, *rest = argv
    if command == "save":
        run_save(ckpt_dir, *rest)
    elif command == "prune":
        keep_last, point = rest
        install_prune_point(ckpt_dir, point)
        retention.prune_checkpoints(ckpt_dir, int(keep_last))
    else:
        raise SystemExit(f"unknown command {command!r}: save or prune")
    print(f"kill point {rest[-1]} was never reached", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
