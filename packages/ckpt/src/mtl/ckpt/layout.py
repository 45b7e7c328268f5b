"""The global layout of a checkpoint, from every rank's shard descriptions.

Each rank describes its ``ShardedTensor``s as small ``ShardRecord``s; after an all-gather,
every rank runs the same checks on the same list, so a bad layout fails on all ranks at once
(no rank is left waiting at a barrier). The checks: shards of a key agree on global shape and
dtype, the written shards (``replica_id == 0``) do not overlap and cover the whole tensor,
and every replica matches a written shard. The chunk shape of each zarr array follows the
shard boundaries so that no chunk is written by two ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtl.core.errors import CheckpointError


@dataclass(frozen=True)
class ShardRecord:
    """What one rank tells the others about one of its shards (cheap to pickle)."""

    key: str
    dtype: str  # logical dtype name, e.g. "bfloat16"
    global_shape: tuple
    offset: tuple
    shape: tuple  # local shape
    replica_id: int
    rank: int


@dataclass(frozen=True)
class TensorLayout:
    """One global tensor: its shape, dtype, chunking and the shards that write it."""

    key: str
    dtype: str
    global_shape: tuple
    chunk_shape: tuple
    writers: tuple  # ShardRecords with replica_id == 0, sorted by offset

    def written_by(self, rank: int) -> list[ShardRecord]:
        return [rec for rec in self.writers if rec.rank == rank]


def _describe(records: list[ShardRecord]) -> str:
    return ", ".join(f"rank {r.rank} offset {r.offset} shape {r.shape}" for r in records[:4])


def _overlaps(a: ShardRecord, b: ShardRecord) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offset, a.shape, b.offset, b.shape)
    )


def _chunk_shape(global_shape: tuple, writers: list[ShardRecord]) -> tuple:
    """The largest shard shape when every shard sits on its grid (a shard cut short by the
    tensor's end, such as the last rows of a padded vocabulary, still does), otherwise the
    per-dimension gcd of every shard boundary: either way each chunk lies inside one shard."""
    largest = tuple(max(rec.shape[d] for rec in writers) for d in range(len(global_shape)))
    if all(n > 0 for n in largest) and all(
        o % c == 0 and ((o + n) % c == 0 or o + n == total)
        for rec in writers
        for o, n, c, total in zip(rec.offset, rec.shape, largest, global_shape)
    ):
        return largest
    chunk = []
    for dim, total in enumerate(global_shape):
        step = 0
        for rec in writers:
            step = math.gcd(step, rec.offset[dim])
            step = math.gcd(step, rec.offset[dim] + rec.shape[dim])
        chunk.append(max(step, 1) if total > 0 else 1)
    return tuple(chunk)


def plan_layout(records: list[ShardRecord]) -> dict[str, TensorLayout]:
    """Check that the gathered shards tile every global tensor; return the layout per key."""
    by_key: dict[str, list[ShardRecord]] = {}
    for rec in records:
        by_key.setdefault(rec.key, []).append(rec)

    layouts: dict[str, TensorLayout] = {}
    for key, recs in sorted(by_key.items()):
        first = recs[0]
        for rec in recs[1:]:
            if rec.global_shape != first.global_shape:
                raise CheckpointError(
                    f"tensor '{key}': rank {first.rank} says global shape {first.global_shape} but rank "
                    f"{rec.rank} says {rec.global_shape}; every rank must describe the same global tensor"
                )
            if rec.dtype != first.dtype:
                raise CheckpointError(
                    f"tensor '{key}': rank {first.rank} holds {first.dtype} but rank {rec.rank} holds "
                    f"{rec.dtype}; cast the shards to one dtype before saving"
                )
        writers = sorted((r for r in recs if r.replica_id == 0), key=lambda r: (r.offset, r.rank))
        for i, a in enumerate(writers):
            for b in writers[i + 1 :]:
                if _overlaps(a, b):
                    raise CheckpointError(
                        f"tensor '{key}': shards overlap (rank {a.rank} offset {a.offset} shape {a.shape} and "
                        f"rank {b.rank} offset {b.offset} shape {b.shape}); mark copies with replica_id != 0"
                    )
        covered = sum(math.prod(r.shape) for r in writers)
        total = math.prod(first.global_shape)
        if covered != total:
            raise CheckpointError(
                f"tensor '{key}': the shards with replica_id 0 cover {covered} of {total} elements of global "
                f"shape {first.global_shape} ({_describe(writers) or 'none'}); some slice has no writer — "
                "give exactly one copy of each slice replica_id 0"
            )
        boxes = {(r.offset, r.shape) for r in writers}
        for rec in recs:
            if rec.replica_id != 0 and (rec.offset, rec.shape) not in boxes:
                raise CheckpointError(
                    f"tensor '{key}': rank {rec.rank} holds a replica (replica_id {rec.replica_id}) of offset "
                    f"{rec.offset} shape {rec.shape}, but no rank writes that exact slice"
                )
        layouts[key] = TensorLayout(
            key=key,
            dtype=first.dtype,
            global_shape=first.global_shape,
            chunk_shape=_chunk_shape(first.global_shape, writers),
            writers=tuple(writers),
        )
    return layouts
