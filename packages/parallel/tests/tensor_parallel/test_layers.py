"""Column/row-parallel linears at tp=2 equal the same layers at tp=1 (same full weights).

Each rank builds the tp=1 reference from the full weights and its tp=2 shard from the same
tensors; outputs and gradients gathered to full shape must match within 1e-6 (fp32).
"""

import pytest
import torch
import torch.distributed as dist

from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads, has_sequence_parallel_grad
from mtl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mtl.parallel.tensor_parallel.sharding import full_from_shards
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import param_layout

TOL = dict(rtol=1e-6, atol=1e-6)
S, B, H, FFN = 8, 2, 16, 32


def gather_dim(t: torch.Tensor, dim: int, group, stride: int = 1) -> torch.Tensor:
    shards = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, t.contiguous(), group=group)
    return full_from_shards(shards, dim, stride)


def full_weights(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "w1": torch.randn(FFN, H, generator=g) * 0.1,
        "b1": torch.randn(FFN, generator=g) * 0.1,
        "w2": torch.randn(H, FFN, generator=g) * 0.1,
        "b2": torch.randn(H, generator=g) * 0.1,
        "x": torch.randn(S, B, H, generator=g),
        "dy": torch.randn(S, B, H, generator=g),
    }
    return {name: t.to(device) for name, t in tensors.items()}


def mlp_equivalence(sequence_parallel: bool, device: str):
    """Column(gelu) -> Row, the MLP pattern, at tp=2 vs tp=1."""
    topo = Topology.build(tp=2)
    group = topo.tp_group
    t = full_weights(seed=1, device=device)

    ref1 = ColumnParallelLinear(H, FFN, bias=True, topology=None, device=device)
    ref2 = RowParallelLinear(FFN, H, bias=True, topology=None, device=device)
    ref1.load_full(t["w1"], t["b1"])
    ref2.load_full(t["w2"], t["b2"])
    x_ref = t["x"].clone().requires_grad_()
    y_ref = ref2(torch.nn.functional.gelu(ref1(x_ref)))
    y_ref.backward(t["dy"])

    col = ColumnParallelLinear(H, FFN, bias=True, topology=topo, sequence_parallel=sequence_parallel, device=device)
    row = RowParallelLinear(FFN, H, bias=True, topology=topo, sequence_parallel=sequence_parallel, device=device)
    col.load_full(t["w1"], t["b1"])
    row.load_full(t["w2"], t["b2"])
    assert col.weight.shape == (FFN // 2, H) and row.weight.shape == (H, FFN // 2)
    assert [param_layout(p).tp_split_dim for p in (col.weight, col.bias, row.weight)] == [0, 0, 1]
    assert param_layout(row.bias).tp_split_dim is None

    x_full = t["x"]
    dy = t["dy"]
    if sequence_parallel:  # activations outside the pair are [s/tp, b, h]
        x_full = x_full.chunk(2, dim=0)[topo.tp_rank]
        dy = dy.chunk(2, dim=0)[topo.tp_rank]
    x = x_full.clone().requires_grad_()
    y = row(torch.nn.functional.gelu(col(x)))
    y.backward(dy)

    if sequence_parallel:
        # the row bias sees this rank's tokens only: its gradient is summed at the step's end
        assert [p for p in (*col.parameters(), *row.parameters()) if has_sequence_parallel_grad(p)] == [row.bias]
        assert allreduce_sequence_parallel_grads([*col.parameters(), *row.parameters()], group) == 1
        assert y.shape == (S // 2, B, H)
        y, x_grad = gather_dim(y, 0, group), gather_dim(x.grad, 0, group)
    else:
        assert y.shape == (S, B, H)
        x_grad = x.grad
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(x_grad, x_ref.grad, **TOL)
    torch.testing.assert_close(gather_dim(col.weight.grad, 0, group), ref1.weight.grad, **TOL)
    torch.testing.assert_close(gather_dim(col.bias.grad, 0, group), ref1.bias.grad, **TOL)
    torch.testing.assert_close(gather_dim(row.weight.grad, 1, group), ref2.weight.grad, **TOL)
    torch.testing.assert_close(row.bias.grad, ref2.bias.grad, **TOL)  # complete on every rank


def strided_column(sequence_parallel: bool, device: str):
    """stride=2 (a fused [gate; up] weight): each rank holds its half of *each* block."""
    topo = Topology.build(tp=2)
    group = topo.tp_group
    t = full_weights(seed=3, device=device)
    x_ref = t["x"].clone().requires_grad_()
    w_ref = t["w1"].clone().requires_grad_()
    y_ref = x_ref @ w_ref.T  # [s, b, ffn] = [gate | up]
    y_ref.backward(torch.ones_like(y_ref))

    col = ColumnParallelLinear(H, FFN, bias=False, topology=topo, stride=2, sequence_parallel=sequence_parallel, device=device)
    col.load_full(t["w1"])
    assert param_layout(col.weight).tp_stride == 2
    x = (t["x"].chunk(2, dim=0)[topo.tp_rank] if sequence_parallel else t["x"]).clone().requires_grad_()
    y = col(x)  # [s, b, ffn/tp] = [my gate half | my up half]
    gate_ref, up_ref = y_ref.chunk(2, dim=-1)
    gate, up = y.chunk(2, dim=-1)
    torch.testing.assert_close(gate, gate_ref.chunk(2, dim=-1)[topo.tp_rank], **TOL)
    torch.testing.assert_close(up, up_ref.chunk(2, dim=-1)[topo.tp_rank], **TOL)
    y.backward(torch.ones_like(y))
    x_grad = gather_dim(x.grad, 0, group) if sequence_parallel else x.grad
    torch.testing.assert_close(x_grad, x_ref.grad, **TOL)
    torch.testing.assert_close(gather_dim(col.weight.grad, 0, group, stride=2), w_ref.grad, **TOL)


def gather_output_and_unsplit_input(device: str):
    """Column with gather_output=True, Row with input_is_parallel=False, no biases; the
    two share one full weight W (y = (x Wᵀ) W), so W's gradient sums both layers'."""
    topo = Topology.build(tp=2)
    group = topo.tp_group
    t = full_weights(seed=2, device=device)
    x_ref = t["x"].clone().requires_grad_()
    w_ref = t["w1"].clone().requires_grad_()
    y_ref = (x_ref @ w_ref.T) @ w_ref  # [s, b, h] -> [s, b, ffn] -> [s, b, h]
    y_ref.backward(t["dy"])

    col = ColumnParallelLinear(H, FFN, bias=False, topology=topo, gather_output=True, device=device)
    row = RowParallelLinear(FFN, H, bias=False, topology=topo, input_is_parallel=False, device=device)
    col.load_full(t["w1"])
    row.load_full(t["w1"].T.contiguous())
    x = t["x"].clone().requires_grad_()
    mid = col(x)
    assert mid.shape == (S, B, FFN)
    y = row(mid)
    y.backward(t["dy"])
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    w_grad = gather_dim(col.weight.grad, 0, group) + gather_dim(row.weight.grad, 1, group).T
    torch.testing.assert_close(w_grad, w_ref.grad, **TOL)


def all_cases(device: str = "cpu"):
    for sequence_parallel in (False, True):
        mlp_equivalence(sequence_parallel, device)
        strided_column(sequence_parallel, device)
    gather_output_and_unsplit_input(device)
    return "ok"


def test_parallel_linears_at_tp2_equal_tp1():
    assert run_distributed(all_cases, world_size=2) == ["ok", "ok"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_parallel_linears_at_tp2_equal_tp1_on_gpus_with_nccl():
    assert run_distributed(all_cases, world_size=2, args=("cuda",), backend="nccl") == ["ok", "ok"]
