"""Finding torchrun's worker processes from a test, to kill one as a failing node would (Linux /proc)."""

from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (none if it has gone meanwhile)."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def rank_of(pid: int) -> int | None:
    """The ``RANK`` torchrun gave process ``pid``, or None (not a worker, or gone)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(item[5:]) for item in env if item.startswith(b"RANK=")), None)
