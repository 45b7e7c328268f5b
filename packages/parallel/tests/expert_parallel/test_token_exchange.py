"""TokenExchange on 2 gloo processes with 4 experts (2 per rank): each rank's experts get
exactly the rows routed to them, sorted by local expert then source rank, with the right
counts; their outputs come back to the sender in its order; gradients flow back too. One
process with every expert local gives the same outputs."""

import torch
import torch.distributed as dist

from mtl.parallel.expert_parallel import TokenExchange
from mtl.parallel.testing import run_distributed

NUM_EXPERTS = 4
# ROUTES[rank]: the global expert of each of that rank's rows (uneven; expert 1 gets none)
ROUTES = [[3, 0, 2, 0, 3], [2, 2, 0, 3]]


def rows_of(rank: int) -> torch.Tensor:
    """Row t of rank r is [10 r + t, -(10 r + t)]: its value says where it came from."""
    values = torch.tensor([10.0 * rank + t for t in range(len(ROUTES[rank]))])
    return torch.stack([values, -values], dim=1)


def exchange(rank: int, group) -> dict:
    route = torch.tensor(ROUTES[rank])
    order = torch.argsort(route, stable=True)  # rows sorted by global expert
    rows = rows_of(rank)[order].requires_grad_()
    ex = TokenExchange(torch.bincount(route, minlength=NUM_EXPERTS), group)
    local = ex.dispatch(rows)
    num_local = NUM_EXPERTS // (dist.get_world_size(group) if group is not None else 1)
    first = rank * num_local if group is not None else 0
    expert = first + torch.repeat_interleave(torch.arange(num_local), ex.tokens_per_local_expert)
    back = ex.combine(local * (expert + 1.0)[:, None])  # a fake expert e multiplies by e + 1
    back.sum().backward()
    return {"local": local.detach()[:, 0].tolist(), "counts": ex.tokens_per_local_expert.tolist(),
            "back": back.detach()[:, 0].tolist(), "grad": rows.grad[:, 0].tolist(),
            "sorted_route": route[order].tolist(), "sorted_values": rows.detach()[:, 0].tolist()}


def on_two_ranks():
    return exchange(dist.get_rank(), dist.new_group([0, 1]))


def expected_local(rank: int) -> tuple[list[float], list[int]]:
    values, counts = [], []
    for expert in (2 * rank, 2 * rank + 1):
        mine = [10.0 * src + t for src in range(2) for t, e in enumerate(ROUTES[src]) if e == expert]
        values += mine
        counts.append(len(mine))
    return values, counts


def test_rows_reach_their_experts_sorted_and_come_back():
    results = run_distributed(on_two_ranks, world_size=2)
    for rank, r in enumerate(results):
        values, counts = expected_local(rank)
        assert r["local"] == values and r["counts"] == counts
        scale = [e + 1.0 for e in r["sorted_route"]]
        assert r["back"] == [v * s for v, s in zip(r["sorted_values"], scale)]
        assert r["grad"] == scale
    # ep = 1: the same outputs with every expert on one rank
    for rank, r in enumerate(results):
        single = exchange(rank, None)
        assert single["back"] == r["back"] and single["grad"] == r["grad"]
        assert single["counts"] == [ROUTES[rank].count(e) for e in range(NUM_EXPERTS)]
