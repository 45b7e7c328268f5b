"""``balance_stage_layers``: pipeline stages sized so that the busiest rank is as idle as it can be."""

import itertools

import pytest

from mtl.core.stage_balance import balance_stage_layers


def busiest_rank(costs: list[float], head: float, pp: int, counts: list[int]) -> float:
    ranks, start = [0.0] * pp, 0
    for v, count in enumerate(counts):
        ranks[v % pp] += sum(costs[start:start + count]) + (head if v == len(counts) - 1 else 0.0)
        start += count
    return max(ranks)


def every_split(num_layers: int, stages: int):
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        bounds = (0, *cuts, num_layers)
        yield [bounds[v + 1] - bounds[v] for v in range(stages)]


@pytest.mark.parametrize("pp,vpp,expected", [
    (2, 1, [13, 11]),  # rank 1's 11 layers + the head (1.9 layers' work) against 13
    (2, 2, [7, 6, 6, 5]),
    (2, 4, [4, 3, 3, 3, 3, 3, 3, 2]),
    (4, 1, [6, 6, 7, 5]),  # the extra layer on rank 2, which keeps 2 micro-batches in flight, not rank 0's 4
    (8, 1, [3, 3, 3, 3, 3, 3, 4, 2]),  # the layer off the head's stage goes next door, not to rank 0
])
def test_the_reference_model(pp, vpp, expected):
    """24 equal layers and an LM head worth 1.9 of them (benchmarks/gpu/llama_reference.toml)."""
    assert balance_stage_layers([1.0] * 24, 1.9, pp, vpp) == expected


def test_without_a_head_equal_layers_split_evenly():
    assert balance_stage_layers([2.0] * 24, 0.0, 2, 2) == [6, 6, 6, 6]


def test_every_stage_keeps_a_layer_however_heavy_the_head():
    assert balance_stage_layers([1.0] * 4, 100.0, 2, 1) == [3, 1]
    assert balance_stage_layers([1.0] * 4, 100.0, 2, 2) == [1, 1, 1, 1]


def test_equal_layers_get_the_best_split():
    """Against every split of small models: no other leaves the busiest rank less work."""
    for pp, vpp, head in itertools.product((2, 3, 4), (1, 2), (0.0, 0.5, 1.9, 3.0, 10.0)):
        stages = pp * vpp
        for num_layers in range(stages, min(stages + 7, 13)):
            costs = [1.0] * num_layers
            best = min(busiest_rank(costs, head, pp, split) for split in every_split(num_layers, stages))
            got = balance_stage_layers(costs, head, pp, vpp)
            assert sum(got) == num_layers and min(got) >= 1
            assert busiest_rank(costs, head, pp, got) == pytest.approx(best), (pp, vpp, head, num_layers, got)


def test_mixed_layers_at_one_chunk_per_rank_get_the_best_split():
    """Dense layers then MoE layers three times as costly, vpp = 1: the exact split, as every
    split of the model confirms (at vpp > 1 the search may stop at a local best)."""
    for pp, head, dense in itertools.product((2, 3, 4), (0.0, 1.9, 10.0), (1, 3)):
        costs = [1.0] * dense + [3.0] * 9
        best = min(busiest_rank(costs, head, pp, split) for split in every_split(len(costs), pp))
        assert busiest_rank(costs, head, pp, balance_stage_layers(costs, head, pp, 1)) == pytest.approx(best)


def test_mixed_layers_never_worse_than_the_even_split():
    costs = [1.0] * 3 + [3.0] * 29
    for pp, vpp in ((2, 2), (4, 2), (2, 4)):
        got = balance_stage_layers(costs, 1.9, pp, vpp)
        even = [len(costs) // (pp * vpp)] * (pp * vpp)
        assert busiest_rank(costs, 1.9, pp, got) < busiest_rank(costs, 1.9, pp, even)


def test_too_few_layers_are_refused():
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        balance_stage_layers([1.0] * 3, 0.0, 2, 2)
