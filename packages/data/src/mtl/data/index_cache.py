"""On-disk cache of dataset index arrays, keyed by a hash of what determines them.

Each entry is ``<hash>-<name>.npy`` plus ``<hash>-description.json`` (written last, so its
presence means the arrays are complete). Files are written under temporary names and renamed,
so ranks that build the same entry concurrently never read a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import numpy as np

from mtl.core.errors import DataError


def description_hash(description: dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def load_or_build(cache_dir: str, description: dict[str, Any], names: tuple[str, ...],
                  build: Callable[[], tuple[np.ndarray, ...]]) -> tuple[tuple[np.ndarray, ...], bool]:
    """(arrays, loaded_from_cache). ``build()`` returns one array per name, in order."""
    key = description_hash(description)
    paths = [os.path.join(cache_dir, f"{key}-{name}.npy") for name in names]
    description_path = os.path.join(cache_dir, f"{key}-description.json")
    if os.path.isfile(description_path) and all(os.path.isfile(p) for p in paths):
        try:
            return tuple(np.load(p, mmap_mode="r") for p in paths), True
        except (OSError, ValueError) as exc:
            raise DataError(f"index cache entry {paths[0]} is unreadable ({exc}); delete "
                            f"{cache_dir} and run again to rebuild it") from exc
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        suffix = f".tmp{os.getpid()}"
        for path, array in zip(paths, arrays):
            with open(path + suffix, "wb") as f:
                np.save(f, array)
            os.replace(path + suffix, path)
        with open(description_path + suffix, "w", encoding="utf-8") as f:
            json.dump(description, f, indent=1, sort_keys=True)
        os.replace(description_path + suffix, description_path)
    except OSError as exc:
        raise DataError(f"cannot write the index cache in {cache_dir} ({exc}); set "
                        "data.cache_dir to a writable folder") from exc
    return arrays, False
