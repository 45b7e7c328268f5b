"""AllToAllDispatcher (ep=2, 2 gloo processes) equals LocalDispatcher with every expert on one
rank, with a capacity mask dropping some slots: the combined outputs, the tokens' gradients,
and each expert's weight gradient summed over every rank's tokens (what the ranks holding it
reduce). The fake experts multiply by a per-expert matrix, so a row sent to the wrong expert,
or a gradient sent to the wrong rank, changes the numbers."""

import torch
import torch.distributed as dist

from mtl.models.moe.alltoall_dispatch import AllToAllDispatcher
from mtl.models.moe.dispatch import LocalDispatcher, build_dispatcher
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

NUM_EXPERTS, TOP_K, TOKENS, HIDDEN = 4, 2, 7, 3


def inputs(rank: int):
    g = torch.Generator().manual_seed(rank)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g)
    probs = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), dim=-1)
    expert_ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    keep = torch.rand(TOKENS, TOP_K, generator=g) > 0.25  # some slots over capacity
    return hidden, probs, expert_ids, keep


def expert_weights() -> torch.Tensor:
    return torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(99))


def run(dispatcher, weights: torch.nn.Parameter, rank: int):
    """The combined output and the tokens' gradient; ``weights.grad`` accumulates."""
    hidden, probs, expert_ids, keep = inputs(rank)
    hidden.requires_grad_()

    def experts(tokens, tokens_per_expert):  # [N, h] sorted by local expert
        local = torch.repeat_interleave(torch.arange(weights.shape[0]), tokens_per_expert)
        return torch.einsum("nh,nhk->nk", tokens, weights[local])

    out = dispatcher(hidden, probs, expert_ids, keep, experts)
    (out * torch.arange(1.0, 1.0 + out.numel()).view_as(out)).sum().backward()
    return out.detach(), hidden.grad


def ep2_against_local():
    topo = Topology.build(ep=2)
    dispatcher = build_dispatcher(NUM_EXPERTS, topo)
    assert isinstance(dispatcher, AllToAllDispatcher)
    first = topo.ep_rank * NUM_EXPERTS // 2
    mine = torch.nn.Parameter(expert_weights()[first : first + NUM_EXPERTS // 2].clone())
    out, grad = run(dispatcher, mine, topo.rank)

    full = torch.nn.Parameter(expert_weights())
    ref_out, ref_grad = run(LocalDispatcher(NUM_EXPERTS), full, topo.rank)
    for other in range(dist.get_world_size()):  # every rank's tokens reach the experts
        if other != topo.rank:
            run(LocalDispatcher(NUM_EXPERTS), full, other)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.grad, full.grad[first : first + NUM_EXPERTS // 2], rtol=1e-6, atol=1e-6)
    return int(inputs(topo.rank)[3].sum())


def test_ep2_dispatch_equals_local_dispatch_with_dropped_slots():
    kept = run_distributed(ep2_against_local, world_size=2)
    assert all(0 < k < TOKENS * TOP_K for k in kept)  # the mask really drops some slots
