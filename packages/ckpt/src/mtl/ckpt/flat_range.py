"""A flat range of a box as exact sub-boxes, so it can be loaded like any other shard.

A ZeRO-style optimizer owns ``box.view(-1)[first:last]`` of a tensor: a contiguous range of
the flattened box, not a box itself. In C order such a range is at most a partial first row,
a block of whole rows and a partial last row, recursively in the inner dimensions, so it
splits into at most ``2 * ndim - 1`` boxes, each contiguous in the flat range. Each becomes a
``ShardedTensor`` whose data is a view of the flat data: loading them fills the range in
place, and a rank reads only the elements it owns.
"""

from __future__ import annotations

import math

import torch

from mtl.ckpt.sharded import ShardedTensor
from mtl.core.errors import CheckpointError

# (offset inside the box, shape, index of the sub-box's first element in the flat box)
SubBox = tuple[tuple[int, ...], tuple[int, ...], int]


def flat_range_boxes(shape: tuple[int, ...], first: int, last: int) -> list[SubBox]:
    """The boxes that tile ``[first, last)`` of a C-ordered tensor of ``shape``, in order."""
    if first >= last:
        return []
    if len(shape) <= 1:
        return [((first,), (last - first,), first)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    row_first, col_first = divmod(first, inner)
    row_last, col_last = divmod(last, inner)

    def in_row(row: int, lo: int, hi: int) -> list[SubBox]:
        return [((row, *o), (1, *n), row * inner + f) for o, n, f in flat_range_boxes(shape[1:], lo, hi)]

    if row_first == row_last:  # inside one row
        return in_row(row_first, col_first, col_last)
    boxes: list[SubBox] = []
    if col_first:
        boxes += in_row(row_first, col_first, inner)
        row_first += 1
    if row_last > row_first:
        boxes.append(((row_first, *[0] * (len(shape) - 1)), (row_last - row_first, *shape[1:]), row_first * inner))
    if col_last:
        boxes += in_row(row_last, 0, col_last)
    return boxes


def flat_range_shards(key: str, flat_data: torch.Tensor, box_shape: tuple[int, ...], box_offset: tuple[int, ...],
                      global_shape: tuple[int, ...], first: int, *, limit_rows: int | None = None,
                      replica_id: int = 0) -> list[ShardedTensor]:
    """``ShardedTensor``s for ``flat_data``, which holds ``[first, first + numel)`` of the
    flattened box ``box_shape`` at ``box_offset`` of the global tensor ``key``.

    ``limit_rows`` keeps only the box's first rows (the rest, e.g. vocabulary padding, is not
    part of the global tensor and stays untouched on load)."""
    if flat_data.dim() != 1:
        raise CheckpointError(f"flat_range_shards '{key}': flat_data must be 1-D, got shape {tuple(flat_data.shape)}")
    last = first + flat_data.numel()
    if last > math.prod(box_shape):
        raise CheckpointError(
            f"flat_range_shards '{key}': range [{first}, {last}) exceeds the box {tuple(box_shape)}"
        )
    shards = []
    for offset, shape, start in flat_range_boxes(tuple(box_shape), first, last):
        if limit_rows is not None and shape:
            rows = min(offset[0] + shape[0], limit_rows) - offset[0]
            if rows <= 0:
                continue
            data = flat_data[start - first : start - first + math.prod(shape)].view(shape)[:rows]
        else:
            data = flat_data[start - first : start - first + math.prod(shape)].view(shape)
        global_offset = tuple(o + b for o, b in zip(offset, box_offset))
        shards.append(ShardedTensor(key, data, global_shape, global_offset, replica_id))
    return shards
