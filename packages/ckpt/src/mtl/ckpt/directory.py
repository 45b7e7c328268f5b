"""The on-disk layout of a checkpoint directory and its atomic commit.

    ckpt_dir/
      latest                    "12\n": the last committed iteration (replaced atomically)
      iter_0000012/             a committed checkpoint
        zarr.json               a zarr v3 group, so zarr-python can open the whole iteration
        metadata.json           user metadata, common state, per-tensor layout and checksums
        arrays/<key>/           one zarr v3 array per tensor (key percent-encoded)
      iter_0000013.partial/     a save in progress or one that crashed: never read

A save writes everything under ``iter_N.partial``, renames it to ``iter_N`` (atomic on one
file system) and only then replaces ``latest``; a crash at any point leaves ``latest``
naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from mtl.core.errors import CheckpointError

FORMAT_NAME = "mtl-zarr"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
ARRAYS_DIR = "arrays"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(ckpt_dir: str, iteration: int) -> str:
    return os.path.join(ckpt_dir, f"iter_{iteration:07d}")


def partial_dir(ckpt_dir: str, iteration: int) -> str:
    return iteration_dir(ckpt_dir, iteration) + ".partial"


def create_partial(path: str) -> None:
    """An empty ``iter_N.partial`` (replacing one a crashed write of the same iteration left):
    the zarr group and its ``arrays`` subgroup, ready for the arrays."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(os.path.join(path, ARRAYS_DIR))
    group_meta = {"zarr_format": 3, "node_type": "group", "attributes": {}}
    for folder in (path, os.path.join(path, ARRAYS_DIR)):
        with open(os.path.join(folder, "zarr.json"), "w") as f:
            json.dump(group_meta, f)


def committed_iterations(ckpt_dir: str) -> list[int]:
    """Iterations with a committed directory (``.partial`` ones are skipped), ascending."""
    found = []
    for name in os.listdir(ckpt_dir):
        match = _ITER_RE.match(name)
        if match and os.path.isfile(os.path.join(ckpt_dir, name, METADATA_FILE)):
            found.append(int(match.group(1)))
    return sorted(found)


def _require_dir(ckpt_dir: str) -> None:
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist; check ckpt.load / the path")


def latest_iteration(ckpt_dir: str) -> int:
    """The iteration named by ``ckpt_dir/latest`` (the last committed save)."""
    _require_dir(ckpt_dir)
    path = os.path.join(ckpt_dir, LATEST_FILE)
    if not os.path.isfile(path):
        committed = committed_iterations(ckpt_dir)
        hint = f"committed iterations found: {committed[-5:]}; pass iteration=N" if committed else "no checkpoint was ever committed here"
        raise CheckpointError(f"{ckpt_dir} has no '{LATEST_FILE}' file ({hint})")
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number but holds {text[:40]!r}; rewrite it or pass iteration=N")
    return int(text)


def write_latest(ckpt_dir: str, iteration: int) -> None:
    """Point ``latest`` at ``iteration``: write a temp file, fsync, then ``os.replace``."""
    tmp = os.path.join(ckpt_dir, f".{LATEST_FILE}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, LATEST_FILE))
    _fsync_dir(ckpt_dir)


def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (directories cannot be fsynced on some systems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(ckpt_dir: str, iteration: int) -> None:
    """Rename ``iter_N.partial`` to ``iter_N`` and then update ``latest``."""
    final = iteration_dir(ckpt_dir, iteration)
    os.rename(partial_dir(ckpt_dir, iteration), final)
    _fsync_dir(ckpt_dir)
    write_latest(ckpt_dir, iteration)


def resolve_iteration(ckpt_dir: str, iteration: int | None) -> int:
    """``iteration``, or the latest one; the committed directory must exist."""
    _require_dir(ckpt_dir)
    if iteration is None:
        iteration = latest_iteration(ckpt_dir)
    if not os.path.isfile(os.path.join(iteration_dir(ckpt_dir, iteration), METADATA_FILE)):
        committed = committed_iterations(ckpt_dir)
        raise CheckpointError(
            f"iteration {iteration} is not a committed checkpoint in {ckpt_dir} (committed: "
            f"{committed[-5:] or 'none'}); an interrupted save leaves only a '.partial' directory"
        )
    return iteration


def read_manifest(ckpt_dir: str, iteration: int | None = None) -> dict[str, Any]:
    """The whole ``metadata.json`` of a committed iteration (the latest by default): user
    metadata, common state, and per-tensor layout with checksums."""
    iteration = resolve_iteration(ckpt_dir, iteration)
    path = os.path.join(iteration_dir(ckpt_dir, iteration), METADATA_FILE)
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); the checkpoint is corrupt — load another iteration") from exc
    if payload.get("format") != FORMAT_NAME or "tensors" not in payload:
        raise CheckpointError(f"{path} is not an mtl-ckpt '{FORMAT_NAME}' metadata file")
    if payload.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {payload['format_version']}, newer than this mtl-ckpt reads "
            f"({FORMAT_VERSION}); upgrade mtl-ckpt"
        )
    return payload


def read_metadata(ckpt_dir: str, iteration: int | None = None) -> dict[str, Any]:
    """The ``metadata`` dict given to ``save`` for a committed iteration (the latest by default)."""
    return read_manifest(ckpt_dir, iteration)["metadata"]


def list_keys(ckpt_dir: str, iteration: int | None = None) -> list[str]:
    """The tensor keys stored in a committed iteration, sorted."""
    return sorted(read_manifest(ckpt_dir, iteration)["tensors"])


def array_path(ckpt_dir: str, iteration: int, entry: dict[str, Any]) -> str:
    return os.path.join(iteration_dir(ckpt_dir, iteration), entry["path"])
