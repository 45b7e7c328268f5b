"""Megatron-LM's save directory: ``latest_checkpointed_iteration.txt`` naming the newest
iteration (or ``release``), and one ``iter_NNNNNNN/`` (or ``release/``) folder per saved
checkpoint. ``--load`` takes the save directory; a single checkpoint folder works as well.
"""

from __future__ import annotations

from pathlib import Path

from mtl.core.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iteration_folder(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def read_tracker(save_dir: Path) -> int | str:
    """The iteration ``latest_checkpointed_iteration.txt`` names: an int, or ``release``."""
    text = (save_dir / TRACKER).read_text().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{save_dir / TRACKER} holds {text!r}, not an iteration number or 'release'") from None


def checkpoint_dir(src: str | Path, iteration: int | None = None) -> Path:
    """The one checkpoint folder ``src`` designates: ``src`` itself when it is one (it holds
    ``.metadata``), else the save directory's ``iteration`` (default: the tracker's)."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory: give Megatron's save directory (the one --load takes) "
                              "or one iter_NNNNNNN folder")
    if (src / ".metadata").is_file():
        if iteration is not None:
            raise CheckpointError(f"{src} is one checkpoint (it holds .metadata); --iteration picks a checkpoint of a "
                                  "save directory: give the folder above it")
        return src
    available = sorted(p.name for p in src.glob("iter_*") if p.is_dir()) + ([RELEASE] if (src / RELEASE).is_dir() else [])
    if iteration is None:
        if not (src / TRACKER).is_file():
            hint = f"; it has {', '.join(available[-3:])}: pass --iteration N" if available else ""
            raise CheckpointError(f"{src} has no {TRACKER} and no .metadata: not a Megatron save directory or "
                                  f"checkpoint{hint}")
        iteration = read_tracker(src)
    folder = src / iteration_folder(iteration)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist (iteration {iteration}); {src} has: "
                              f"{', '.join(available) or 'no iteration folders'}")
    return folder
