"""A sequence-parallel pre-norm MLP block at tp=2 equals the same block at tp=1, and the
bare mappings are each other's adjoints.

Block: y = x + Row(gelu(Column(norm(x)))), with x ``[s/tp, b, h]`` under SP. The norm's
weight and the row layer's bias are replicated: backward leaves each rank its own tokens' part
of their gradients, with no collective of their own, and ``allreduce_sequence_parallel_grads``
(what ``DataParallel.finish_grad_sync`` runs once per step) completes them on every rank.
"""

import pytest
import torch
import torch.distributed as dist

from mtl.parallel.backend_local import LayerNorm, RMSNorm
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads, has_sequence_parallel_grad
from mtl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

TOL = dict(rtol=1e-6, atol=1e-6)
S, B, H, FFN = 8, 2, 16, 32


def gather_dim(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def build_block(norm_cls, topology, sequence_parallel, tensors, device):
    norm = norm_cls(H, 1e-5, topology=topology, sequence_parallel=sequence_parallel).to(device)
    col = ColumnParallelLinear(H, FFN, bias=True, topology=topology, sequence_parallel=sequence_parallel, device=device)
    row = RowParallelLinear(FFN, H, bias=True, topology=topology, sequence_parallel=sequence_parallel, device=device)
    with torch.no_grad():
        norm.weight.copy_(tensors["gamma"])
        if norm.bias is not None:
            norm.bias.copy_(tensors["beta"])
    col.load_full(tensors["w1"], tensors["b1"])
    row.load_full(tensors["w2"], tensors["b2"])
    return norm, col, row


def block_equivalence(norm_cls, device):
    topo = Topology.build(tp=2)
    g = torch.Generator().manual_seed(4)
    t = {
        "gamma": 1 + 0.1 * torch.randn(H, generator=g),
        "beta": 0.1 * torch.randn(H, generator=g),
        "w1": 0.1 * torch.randn(FFN, H, generator=g),
        "b1": 0.1 * torch.randn(FFN, generator=g),
        "w2": 0.1 * torch.randn(H, FFN, generator=g),
        "b2": 0.1 * torch.randn(H, generator=g),
        "x": torch.randn(S, B, H, generator=g),
        "dy": torch.randn(S, B, H, generator=g),
    }
    t = {name: x.to(device) for name, x in t.items()}
    ref_norm, ref_col, ref_row = build_block(norm_cls, None, False, t, device)
    x_ref = t["x"].clone().requires_grad_()
    y_ref = x_ref + ref_row(torch.nn.functional.gelu(ref_col(ref_norm(x_ref))))
    y_ref.backward(t["dy"])

    norm, col, row = build_block(norm_cls, topo, True, t, device)
    x = t["x"].chunk(2, dim=0)[topo.tp_rank].clone().requires_grad_()  # [s/tp, b, h]
    y = x + row(torch.nn.functional.gelu(col(norm(x))))
    assert y.shape == (S // 2, B, H)
    all_reduces = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: all_reduces.append(tensor.shape) or real_all_reduce(
        tensor, *args, **kwargs)
    try:
        y.backward(t["dy"].chunk(2, dim=0)[topo.tp_rank])
    finally:
        dist.all_reduce = real_all_reduce
    assert all_reduces == [], all_reduces  # the replicated parameters' gradients wait for the step's end
    replicated = [p for p in (norm.weight, norm.bias, row.bias) if p is not None]
    assert all(has_sequence_parallel_grad(p) for p in replicated)
    assert not any(has_sequence_parallel_grad(p) for p in (col.weight, col.bias, row.weight))
    partial = [p.grad.clone() for p in replicated]
    params = [*norm.parameters(), *col.parameters(), *row.parameters()]
    assert allreduce_sequence_parallel_grads(params, topo.tp_group) == 1  # one dtype: one all-reduce
    for before, param in zip(partial, replicated):  # this rank's tokens' share, not the whole yet
        assert not torch.allclose(before, param.grad)

    torch.testing.assert_close(gather_dim(y, 0, topo.tp_group), y_ref, **TOL)
    torch.testing.assert_close(gather_dim(x.grad, 0, topo.tp_group), x_ref.grad, **TOL)
    torch.testing.assert_close(norm.weight.grad, ref_norm.weight.grad, **TOL)  # complete on each rank
    if norm.bias is not None:
        torch.testing.assert_close(norm.bias.grad, ref_norm.bias.grad, **TOL)
    torch.testing.assert_close(row.bias.grad, ref_row.bias.grad, **TOL)
    torch.testing.assert_close(gather_dim(col.weight.grad, 0, topo.tp_group), ref_col.weight.grad, **TOL)
    torch.testing.assert_close(gather_dim(row.weight.grad, 1, topo.tp_group), ref_row.weight.grad, **TOL)


def mapping_adjoints(device):
    """<f(x), y> == <x, f*(y)>: the backward of each scatter is its gather and vice versa."""
    topo = Topology.build(tp=2)
    group = topo.tp_group
    g = torch.Generator().manual_seed(5)
    full = torch.randn(S, B, H, generator=g).to(device)
    for scatter, gather, dim in (
        (scatter_to_sequence_parallel, gather_from_sequence_parallel, 0),
        (scatter_to_tensor_parallel, gather_from_tensor_parallel, -1),
    ):
        x = full.clone().requires_grad_()
        local = scatter(x, group)
        assert torch.equal(local, full.chunk(2, dim=dim)[topo.tp_rank])
        local.backward(torch.ones_like(local) * (topo.tp_rank + 1))
        # every rank gets the gathered gradient: rank r's slice filled with r+1
        expected = torch.cat([torch.full_like(c, r + 1.0) for r, c in enumerate(full.chunk(2, dim=dim))], dim=dim)
        torch.testing.assert_close(x.grad, expected)

    local = full.chunk(2, dim=0)[topo.tp_rank].clone().requires_grad_()
    gathered = gather_from_sequence_parallel(local, group, grad_is_partial=False)
    torch.testing.assert_close(gathered, full)
    gathered.backward(full)  # the same full gradient on each rank: keep my slice
    torch.testing.assert_close(local.grad, full.chunk(2, dim=0)[topo.tp_rank])


def all_cases(device: str = "cpu"):
    block_equivalence(RMSNorm, device)
    block_equivalence(LayerNorm, device)
    mapping_adjoints(device)
    return "ok"


def test_sequence_parallel_block_and_mappings_at_tp2():
    assert run_distributed(all_cases, world_size=2) == ["ok", "ok"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_sequence_parallel_block_and_mappings_at_tp2_on_gpus_with_nccl():
    assert run_distributed(all_cases, world_size=2, args=("cuda",), backend="nccl") == ["ok", "ok"]
