"""Context-parallel pieces that need no process group: the cp == 1 path, the block maths, the
mask plan of every block pair, the shard arithmetic and the input checks."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import cp_cases
from mtl.core.errors import ParallelError
from mtl.parallel.context_parallel import (
    context_parallel_attention,
    context_parallel_position_ids,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from mtl.parallel.context_parallel.block_attention import block_forward, merge_partial, merge_partial_into
from mtl.parallel.context_parallel.ring_attention import _block_plan
from mtl.parallel.topology import Topology


@pytest.mark.parametrize("case", cp_cases.CASES, ids=lambda c: c.name)
def test_cp1_matches_reference(case):
    inputs = cp_cases.make_inputs(case)
    q, k, v = (inputs[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out = context_parallel_attention(
        q, k, v, topology=Topology.single(), causal=case.causal, softmax_scale=case.softmax_scale
    )
    out.backward(inputs["dout"])
    tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}[case.dtype]
    reference = cp_cases.reference_attention(case, inputs)
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(got.detach().double(), reference[name], atol=tol, rtol=tol, msg=name)


def test_merging_key_blocks_equals_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 10, 2, 8, generator=gen, dtype=torch.float64) * 4  # large scores: stability
    v = torch.randn(2, 10, 2, 8, generator=gen, dtype=torch.float64)
    full_out, full_lse = block_forward(q, k, v, 0.5, None)
    out = torch.zeros_like(full_out)
    lse = torch.full_like(full_lse, float("-inf"))
    into_out, into_lse = out.clone(), lse.clone()
    for keys in (slice(0, 3), slice(3, 7), slice(7, 10)):
        part = block_forward(q, k[:, keys], v[:, keys], 0.5, None)
        out, lse = merge_partial(out, lse, *part)
        merge_partial_into(into_out[:, 1:], into_lse[:, :, 1:], part[0][:, 1:], part[1][:, :, 1:])  # views, as the ring
        merge_partial_into(into_out[:, :1], into_lse[:, :, :1], part[0][:, :1], part[1][:, :, :1])
    torch.testing.assert_close(out, full_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(into_out, full_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(into_lse, full_lse, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "einsum"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plan_covers_exactly_the_causal_pairs_and_balances_work(cp, fused):
    chunk = 3
    seq = 2 * cp * chunk
    positions = [context_parallel_position_ids(seq, Topology(cp=cp, rank=r)) for r in range(cp)]
    work = []
    for r in range(cp):
        computed = 0  # score entries evaluated, masked ones included
        covered = torch.zeros(seq, seq, dtype=torch.bool)  # [query position, key position]
        for j in range(cp):
            for rows, keys, mask_offset in _block_plan(r, j, chunk, causal=True, fused=fused):
                q_pos, k_pos = positions[r][rows], positions[j][keys]
                pairs = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
                if mask_offset is not None:
                    pairs = pairs.tril(mask_offset)
                assert not covered[q_pos.unsqueeze(1), k_pos.unsqueeze(0)][pairs].any(), "computed twice"
                covered[q_pos.unsqueeze(1), k_pos.unsqueeze(0)] |= pairs
                computed += pairs.numel()
        expected = torch.zeros(seq, seq, dtype=torch.bool)
        mine = positions[r]
        expected[mine] = torch.ones(seq, seq, dtype=torch.bool).tril()[mine]
        assert torch.equal(covered, expected), f"cp={cp} rank {r}"
        work.append(computed)
    assert len(set(work)) == 1, f"unbalanced attention work per rank: {work}"
    # c x c tiles per rank: on the fused path the diagonal step's causal piece spans 4 (one of
    # them all masked, which the kernels skip), the einsum path's three pieces 3; 2 on each of
    # the cp - 1 other steps
    assert work[0] == chunk * chunk * ((4 if fused else 3) + 2 * (cp - 1))


def test_split_layout_and_position_ids_without_processes():
    full = torch.arange(8).reshape(1, 8)
    assert split_for_context_parallel(full, 1, Topology(cp=2, rank=0)).tolist() == [[0, 1, 6, 7]]
    assert split_for_context_parallel(full, -1, Topology(cp=2, rank=1)).tolist() == [[2, 3, 4, 5]]
    assert context_parallel_position_ids(8, Topology(cp=2, rank=1)).tolist() == [2, 3, 4, 5]
    assert split_for_context_parallel(full, 1, Topology.single()) is full
    assert torch.equal(gather_from_context_parallel(full, 1, Topology.single()), full)


def test_bad_sequence_lengths_raise():
    with pytest.raises(ParallelError, match="sequence length 10 must be divisible by 2 \\* cp = 4"):
        split_for_context_parallel(torch.zeros(1, 10), 1, Topology(cp=2, rank=0))
    with pytest.raises(ParallelError, match="divisible by 2 \\* cp = 8"):
        context_parallel_position_ids(12, Topology(cp=4, rank=0))
    with pytest.raises(ParallelError, match="seq_dim 3 is out of range"):
        split_for_context_parallel(torch.zeros(1, 8), 3, Topology(cp=2, rank=0))


@pytest.mark.parametrize(
    "q_shape, kv_shape, message",
    [
        ((1, 8, 3, 4), (1, 8, 2, 4), "3 query heads are not a multiple of 2"),
        ((1, 8, 4, 4), (1, 6, 2, 4), "disagree on batch, local sequence length or head_dim"),
        ((8, 4, 4), (8, 2, 4), "expected 4 dims"),
    ],
)
def test_bad_attention_inputs_raise(q_shape, kv_shape, message):
    q, kv = torch.zeros(q_shape), torch.zeros(kv_shape)
    with pytest.raises(ParallelError, match=message):
        context_parallel_attention(q, kv, kv, topology=Topology.single())


def test_bad_dtype_and_dropout_raise():
    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ParallelError, match="dtypes differ"):
        context_parallel_attention(q, q.double(), q.double(), topology=Topology.single())
    with pytest.raises(ParallelError, match="dropout_p 1.5 must be in"):
        context_parallel_attention(q, q, q, topology=Topology.single(), dropout_p=1.5)


@pytest.mark.parametrize("cp", [2, 3])
def test_gathered_kv_attention_without_mask_at_an_odd_local_length(cp):
    """Non-causal all-gathered attention needs no chunk layout: each rank's block is its whole
    local sequence, whatever its length (3 here), and dK/dV summed over the ranks are exact."""
    from mtl.parallel.context_parallel.all_gather_attention import attention_over_gathered

    torch.manual_seed(3)
    s_local, heads, groups, d = 3, 4, 2, 8
    q = torch.randn(2, cp * s_local, heads, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, cp * s_local, groups, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gathered = torch.stack([k, v], dim=1).transpose(0, 2)  # rank order = sequence order here
    outs = [attention_over_gathered(q[:, r * s_local:(r + 1) * s_local], gathered, cp, r, False, d**-0.5, None)
            for r in range(cp)]
    out = torch.cat(outs, dim=1)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2)
    ).transpose(1, 2)
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=1e-12)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(reference, (q, k, v), dout)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
