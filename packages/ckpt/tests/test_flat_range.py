"""Flat ranges of a box load exactly the elements they own, from a checkpoint of whole boxes."""

import itertools
import math

import pytest
import torch

from mtl.ckpt import ShardedTensor, load, save
from mtl.ckpt.flat_range import flat_range_boxes, flat_range_shards


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_boxes_tile_every_flat_range_exactly(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for first, last in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, first, last)
        assert len(boxes) <= 2 * len(shape) - 1
        covered = []
        for offset, box_shape, start in boxes:
            part = index[tuple(slice(o, o + n) for o, n in zip(offset, box_shape))].reshape(-1)
            assert part.tolist() == list(range(start, start + part.numel()))  # contiguous, as claimed
            covered += part.tolist()
        assert covered == list(range(first, last))


def test_flat_ranges_load_in_place_with_row_limit(tmp_path):
    """A [6, 4] box at rows 2..8 of a [7, 4] tensor (its last row is padding past the tensor),
    read as three flat pieces of one rank: each piece gets exactly its elements."""
    full = torch.arange(28, dtype=torch.float32).view(7, 4)
    save({"t": ShardedTensor("t", full, (7, 4), (0, 0))}, str(tmp_path), 1)
    box = torch.zeros(6, 4)  # rows 2..7 of the global tensor plus one padding row
    flat = box.view(-1)
    pieces = [(0, 5), (5, 18), (18, 24)]
    template = {f"p{i}": flat_range_shards("t", flat[a:b], (6, 4), (2, 0), (7, 4), a, limit_rows=5)
                for i, (a, b) in enumerate(pieces)}
    load(template, str(tmp_path))
    assert torch.equal(box[:5], full[2:7])
    assert torch.equal(box[5], torch.zeros(4))  # the padding row is not part of the tensor
