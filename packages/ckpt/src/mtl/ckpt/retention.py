"""``prune_checkpoints``: keep the newest N committed iterations of a checkpoint directory.

A committed iteration is deleted in two steps: ``iter_N`` is renamed to
``iter_N.deleting`` (one atomic rename, after which no reader sees it as committed), then
the renamed directory is removed. A crash in between leaves only a ``.deleting``
directory, never a half-deleted ``iter_N`` that still looks committed; the next prune
removes it.

Pruning is not collective: call it on the one rank that commits (rank 0), after a save.
"""

from __future__ import annotations

import os
import re
import shutil

from mtl.ckpt import directory
from mtl.core.errors import CheckpointError

__all__ = ["prune_checkpoints"]

DELETING_SUFFIX = ".deleting"
_PARTIAL_RE = re.compile(r"^iter_(\d{7,})\.partial$")
_DELETING_RE = re.compile(r"^iter_(\d{7,})" + re.escape(DELETING_SUFFIX) + "$")


def _remove_tree(ckpt_dir: str, path: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CheckpointError(
            f"pruning {ckpt_dir}: could not remove {path} ({exc}); it is no longer a committed "
            "checkpoint, remove it by hand"
        ) from exc


def discard_iteration(ckpt_dir: str, iteration: int) -> None:
    final = directory.iteration_dir(ckpt_dir, iteration)
    doomed = final + DELETING_SUFFIX
    try:
        os.rename(final, doomed)
    except OSError as exc:
        raise CheckpointError(
            f"pruning {ckpt_dir}: could not rename iteration {iteration} to {doomed} ({exc}); "
            "the iteration is untouched, check the directory's permissions"
        ) from exc
    directory._fsync_dir(ckpt_dir)  # the rename is durable before any file inside goes
    _remove_tree(ckpt_dir, doomed)


def prune_checkpoints(ckpt_dir: str, keep_last: int) -> list[int]:
    """Delete committed iterations of ``ckpt_dir`` older than the newest ``keep_last``;
    returns the deleted iterations, ascending. ``keep_last=0`` keeps everything.

    The iterations kept are the newest ``keep_last`` up to and including the one ``latest``
    names, so ``latest`` is never deleted. Committed iterations newer than ``latest`` (a save
    killed between its rename and the update of ``latest``, or a run rolled back by
    rewriting ``latest``) are left alone, and so are ``iter_N.partial`` directories newer
    than ``latest`` (an async save in flight). Stale ``iter_N.partial`` directories older
    than ``latest`` and leftover ``iter_N.deleting`` directories are removed.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise CheckpointError(
            f"prune_checkpoints(keep_last={keep_last!r}) for {ckpt_dir}: keep_last must be an int >= 0 "
            "(0 keeps every checkpoint)"
        )
    if keep_last == 0:
        return []
    directory._require_dir(ckpt_dir)
    names = os.listdir(ckpt_dir)
    for name in names:  # deletions a crash interrupted
        if _DELETING_RE.match(name):
            _remove_tree(ckpt_dir, os.path.join(ckpt_dir, name))
    committed = directory.committed_iterations(ckpt_dir)
    if not committed and not os.path.exists(os.path.join(ckpt_dir, directory.LATEST_FILE)):
        return []  # nothing was ever committed here
    # raises when 'latest' is missing, garbled or names no committed iteration: without a
    # trustworthy latest we cannot tell which checkpoint must survive, so nothing is deleted
    latest = directory.resolve_iteration(ckpt_dir, None)

    candidates = [it for it in committed if it <= latest]
    removed = candidates[:-keep_last]
    for iteration in removed:  # oldest first: a crash midway keeps the newer ones
        discard_iteration(ckpt_dir, iteration)
    for name in names:
        match = _PARTIAL_RE.match(name)
        if match and int(match.group(1)) < latest:
            _remove_tree(ckpt_dir, os.path.join(ckpt_dir, name))
    return removed
