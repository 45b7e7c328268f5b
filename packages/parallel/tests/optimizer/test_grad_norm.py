"""clip_grad_norm counts every gradient element of the model exactly once.

At tp=2 x pp=2 (4 ranks), each stage holds a column-split, a row-split and a replicated
parameter, plus a tied embedding present on both stages. The norm must equal
``torch.nn.utils.clip_grad_norm_`` over the full, unsplit gradients of the whole model (the
tied one once) within 1e-6, and the clipped shards must equal the clipped full gradients.
"""

import math

import pytest
import torch
from torch import nn

from mtl.core.errors import MtlError, ParallelError
from mtl.parallel.optimizer import check_for_nan, clip_grad_norm
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import set_param_layout

TOL = dict(rtol=1e-6, atol=1e-6)


def full_gradients():
    """The whole model's gradients, the same on every rank: per stage, and the tied embedding."""
    g = torch.Generator().manual_seed(0)
    stages = [{"col": torch.randn(8, 6, generator=g), "row": torch.randn(6, 8, generator=g),
               "norm": torch.randn(5, generator=g)} for _ in range(2)]
    return stages, torch.randn(4, 3, generator=g)


def local_params(topo: Topology, stages, tied) -> list[nn.Parameter]:
    """This rank's shards, flagged as the TP layers and the GPT model flag them."""
    mine, tp_rank = stages[topo.pp_rank], topo.tp_rank

    def param(grad, split_dim=None, shared=False):
        p = nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        set_param_layout(p, tp_split_dim=split_dim, shared_embedding=shared)
        return p

    return [
        param(mine["col"].chunk(2, dim=0)[tp_rank], split_dim=0),
        param(mine["row"].chunk(2, dim=1)[tp_rank], split_dim=1),
        param(mine["norm"]),
        param(tied.chunk(2, dim=0)[tp_rank], split_dim=0, shared=True),  # vocab-parallel, both stages
    ]


def tp2_pp2_clipping():
    topo = Topology.build(tp=2, pp=2)
    stages, tied = full_gradients()
    ref = [nn.Parameter(torch.zeros_like(t)) for s in stages for t in s.values()] + [nn.Parameter(torch.zeros_like(tied))]
    for p, grad in zip(ref, [t for s in stages for t in s.values()] + [tied]):
        p.grad = grad.clone()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref, float("inf")))
    max_norm = 0.5 * ref_norm
    torch.nn.utils.clip_grad_norm_(ref, max_norm)
    clipped_stage = ref[3 * topo.pp_rank : 3 * topo.pp_rank + 3]
    clipped_tied = ref[-1]

    params = local_params(topo, stages, tied)
    measured = clip_grad_norm(params, float("inf"), topo)  # measure only: grads untouched
    assert math.isclose(measured, ref_norm, rel_tol=1e-6), (measured, ref_norm)
    torch.testing.assert_close(params[2].grad, stages[topo.pp_rank]["norm"], rtol=0, atol=0)

    norm = clip_grad_norm(params, max_norm, topo)
    assert math.isclose(norm, ref_norm, rel_tol=1e-6), (norm, ref_norm)
    tp_rank = topo.tp_rank
    torch.testing.assert_close(params[0].grad, clipped_stage[0].grad.chunk(2, dim=0)[tp_rank], **TOL)
    torch.testing.assert_close(params[1].grad, clipped_stage[1].grad.chunk(2, dim=1)[tp_rank], **TOL)
    torch.testing.assert_close(params[2].grad, clipped_stage[2].grad, **TOL)
    torch.testing.assert_close(params[3].grad, clipped_tied.grad.chunk(2, dim=0)[tp_rank], **TOL)

    # An inf on one rank is seen by all, also in a copy that rank does not count (rank 3 is
    # tp_rank 1: its replicated parameter); gradients are then left as they are.
    for bad_rank, bad_param in ((3, 2), (1, 0)):
        params = local_params(topo, stages, tied)
        if topo.rank == bad_rank:
            params[bad_param].grad[0] = float("inf")
        before = [p.grad.clone() for p in params]
        assert not math.isfinite(clip_grad_norm(params, max_norm, topo)), (bad_rank, bad_param)
        for p, b in zip(params, before):
            torch.testing.assert_close(p.grad, b, rtol=0, atol=0)

    loss = torch.tensor(float("nan") if topo.rank == 2 else 1.0)
    assert check_for_nan(loss, topo, raise_error=False) is True
    assert check_for_nan(torch.tensor(1.0), topo, raise_error=False) is False
    with pytest.raises(MtlError, match=r"rank\(s\) \[2\] of 4"):
        check_for_nan(loss, topo)
    return norm


def test_tp2_pp2_norm_equals_single_process_norm():
    norms = run_distributed(tp2_pp2_clipping, world_size=4)
    assert len(set(norms)) == 1  # bit-identical on every rank


def test_single_process_matches_torch_and_refuses_unsharded_params():
    g = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(4))]
    ref = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(4))]
    for p, r in zip(params, ref):
        p.grad = torch.randn(p.shape, generator=g)
        r.grad = p.grad.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(ref, 0.3))
    assert math.isclose(clip_grad_norm(params, 0.3, Topology.single()), expected, rel_tol=1e-6)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, **TOL)
    with pytest.raises(ParallelError, match="use_distributed_optimizer=True"):
        clip_grad_norm(params, 1.0, Topology.single(), grads_are_dp_sharded=True)
    with pytest.raises(ParallelError, match="max_norm"):
        clip_grad_norm(params, 0.0, Topology.single())
