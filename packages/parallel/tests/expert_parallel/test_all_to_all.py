"""The variable-split all-to-all on 2 gloo processes: every row lands on the rank and at the
position a hand-built table says, and the backward returns each output row's gradient to
the row it came from (the reverse exchange); the counts exchange transposes the table."""

import torch
import torch.distributed as dist

from mtl.core.errors import ParallelError
from mtl.parallel.expert_parallel import all_to_all, exchange_counts
from mtl.parallel.testing import run_distributed

# SENDS[i][j]: rows rank i sends to rank j (uneven, one empty)
SENDS = [[1, 3], [2, 0]]


def row(source: int, dest: int, k: int) -> list[float]:
    value = 100.0 * source + 10.0 * dest + k
    return [value, -value]


def weight(dest: int, position: int) -> float:
    """The gradient the receiving rank ``dest`` gives to its output row ``position``."""
    return 1000.0 * dest + position + 1.0


def exchange_on_two_ranks():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    input_splits = SENDS[rank]
    output_splits = [SENDS[i][rank] for i in range(2)]
    rows = [row(rank, j, k) for j in range(2) for k in range(SENDS[rank][j])]
    inp = torch.tensor(rows, requires_grad=True)
    out = all_to_all(inp, output_splits, input_splits, group)
    (out * torch.tensor([weight(rank, p) for p in range(out.shape[0])])[:, None]).sum().backward()
    counts = exchange_counts(torch.tensor(SENDS[rank]).view(2, 1) * torch.tensor([[1, 7]]), group)
    return out.detach().tolist(), inp.grad.tolist(), counts.tolist()


def test_variable_split_exchange_and_its_backward():
    results = run_distributed(exchange_on_two_ranks, world_size=2)
    for rank, (out, grad, counts) in enumerate(results):
        # received: the rows of rank 0 for me, then those of rank 1, each in sent order
        assert out == [row(i, rank, k) for i in range(2) for k in range(SENDS[i][rank])]
        # each input row's gradient is the weight of the position it landed at on its receiver
        expected = []
        for dest in range(2):
            before = sum(SENDS[i][dest] for i in range(rank))  # rows of lower ranks land first
            expected += [[weight(dest, before + k)] * 2 for k in range(SENDS[rank][dest])]
        assert grad == expected
        # counts: row i = what rank i sends me, per local expert (2 experts here: x1 and x7)
        assert counts == [[SENDS[i][rank], 7 * SENDS[i][rank]] for i in range(2)]


def test_one_rank_is_the_identity():
    x = torch.randn(3, 2, requires_grad=True)
    assert all_to_all(x, [3], [3], None) is x
    counts = torch.tensor([[4, 1]])
    assert exchange_counts(counts, None) is counts


def wrong_splits_on_two_ranks():
    group = dist.new_group([0, 1])
    messages = []
    for output_splits, input_splits in (([1], [1]), ([1, 1], [2, 1])):
        try:
            all_to_all(torch.zeros(2, 1), output_splits, input_splits, group)
        except ParallelError as exc:  # mtl's own error type, which the CLI prints without a traceback
            messages.append(str(exc))
    return messages


def test_wrong_splits_are_refused_with_the_splits_named():
    for messages in run_distributed(wrong_splits_on_two_ranks, world_size=2):
        assert len(messages) == 2
        assert "1 input and 1 output splits for a group of 2 ranks" in messages[0]
        assert "input splits [2, 1] do not add up to the 2 input rows" in messages[1]
