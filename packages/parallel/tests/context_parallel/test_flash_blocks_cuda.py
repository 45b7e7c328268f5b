"""The fused block path of ring attention (cuDNN and FlashAttention-2 kernels) against float64
attention, on one GPU.

Keys are split into two blocks as the ring would deliver them; the partial outputs are
merged with the log-sum-exp, and the backward of each block uses the *final* output and
log-sum-exp. The sum over blocks must equal full attention's output and gradients."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import cp_cases
from mtl.parallel.context_parallel.block_attention import merge_partial_into
from mtl.parallel.context_parallel.flash_blocks import (
    _cudnn_ok,
    _flash_ok,
    flash_block_backward,
    flash_block_forward,
    fused_kernel,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernels need CUDA")

B, S, D = 2, 128, 64


def reference(q, k, v, dout, causal, scale, seq: int = S):
    """float64 attention and its q/k/v gradients; k/v groups repeated to the query heads."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.size(2) // k.size(2)
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _gqa_inputs(seed: int, heads: int = 4, groups: int = 2):
    """bf16 q ``[B, S, heads, D]`` and k, v ``[B, S, groups, D]`` (requiring grad), and an output gradient."""
    torch.manual_seed(seed)
    q = torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, groups, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16)


def kernels():
    """Each kernel the ring may run on this GPU (cuDNN's on Hopper, FlashAttention-2 from sm80),
    as SDPA's switches allow."""
    if not torch.cuda.is_available():
        return ["flash"]
    device = torch.device("cuda")
    return [name for name, ok in (("cudnn", _cudnn_ok(device, D)), ("flash", _flash_ok(device, D))) if ok]


@pytest.mark.parametrize("kernel", kernels())
@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_two_key_blocks_merge_to_full_attention(causal, groups, kernel):
    torch.manual_seed(0)
    heads, half = 4, S // 2
    q = torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, groups, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16)
    scale = D**-0.5
    assert fused_kernel(q.device, q.dtype, D) is not None
    # The ring's pieces for causal attention over [first half | second half] of the keys:
    # rows of the first half see the first key block causally; rows of the second half see the
    # first key block fully and the second causally. Without a mask: every row, both blocks.
    first, second, rows = slice(0, half), slice(half, S), slice(None)
    if causal:
        pieces = [(first, first, True), (second, first, False), (second, second, True)]
    else:
        pieces = [(rows, first, False), (rows, second, False)]
    out = torch.zeros(B, S, heads, D, device="cuda")
    lse = torch.full((B, heads, S), float("-inf"), device="cuda")
    for r, keys, is_causal in pieces:
        part_out, part_lse = flash_block_forward(q[:, r], k[:, keys], v[:, keys], scale, is_causal, kernel)
        merge_partial_into(out[:, r], lse[:, :, r], part_out, part_lse)  # as the ring does: in place
    final = out.to(torch.bfloat16)
    dq = torch.zeros(q.shape, device="cuda")
    dk, dv = torch.zeros(k.shape, device="cuda"), torch.zeros(v.shape, device="cuda")
    for r, keys, is_causal in pieces:
        dq_p, dk_p, dv_p = flash_block_backward(dout[:, r], final[:, r], q[:, r], k[:, keys], v[:, keys],
                                                lse[:, :, r], scale, is_causal, kernel)
        dq[:, r] += dq_p
        dk[:, keys] += dk_p
        dv[:, keys] += dv_p
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, causal, scale)
    # bf16 inputs: results agree to bf16 rounding of values of order one
    for name, got, want in [("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)]:
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("groups", [4, 2])
def test_ring_of_one_equals_full_attention(groups):
    """RingAttention end to end on the fused path (one causal piece, the backward from the
    final output and log-sum-exp) against float64 attention over the sequence."""
    from mtl.parallel.context_parallel.ring_attention import RingAttention

    torch.manual_seed(1)
    heads, scale = 4, D**-0.5
    q = torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, groups, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16)
    out = RingAttention.apply(q, k, v, cp_cases.RingOfOne(), True, scale)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, *ref_grads = reference(q.detach(), k.detach(), v.detach(), dout, True, scale)
    for name, got, want in [("out", out, ref_out), *zip(("dq", "dk", "dv"), grads, ref_grads)]:
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_over_gathered_kv_equals_full_attention(cp, compiled):
    """``cp_comm_type = "all_gather"`` on the fused kernels, every cp rank simulated on one GPU:
    each rank's queries against the gathered k/v (rank order, as the all-gather returns it),
    the gradients of the shared gathered tensor summed as the reduce-scatter sums them.
    Compiled with ``fullgraph=True``: the fused pieces and their backward trace without a break."""
    from mtl.parallel.context_parallel import split_for_context_parallel
    from mtl.parallel.context_parallel.all_gather_attention import attention_over_gathered
    from mtl.parallel.topology import Topology

    q, k, v, dout = _gqa_inputs(seed=2)
    scale = D**-0.5
    kernel = fused_kernel(q.device, q.dtype, D)
    assert kernel in ("cudnn", "flash")
    ranks = [Topology(cp=cp, rank=r) for r in range(cp)]
    local_kv = [torch.stack([split_for_context_parallel(t, 1, topo) for t in (k, v)], dim=1).transpose(0, 2)
                for topo in ranks]
    gathered = torch.cat(local_kv, dim=0)  # [cp * s_local, 2, b, groups, d], rank order
    # dynamic=False: one process plays every rank here, so cp_rank changes between calls (a run has one)
    attend = attention_over_gathered
    if compiled:
        attend = torch.compile(attention_over_gathered, fullgraph=True, dynamic=False)
    outs = [attend(split_for_context_parallel(q, 1, topo), gathered, cp, topo.cp_rank, True, scale, kernel)
            for topo in ranks]
    loss = sum((o.float() * split_for_context_parallel(dout, 1, topo).float()).sum() for o, topo in zip(outs, ranks))
    grads = torch.autograd.grad(loss, (q, k, v))
    out = torch.empty_like(q)
    for o, topo in zip(outs, ranks):  # back to sequence order: each rank's two chunks
        c = S // (2 * cp)
        out[:, topo.cp_rank * c:(topo.cp_rank + 1) * c] = o[:, :c]
        out[:, (2 * cp - 1 - topo.cp_rank) * c:(2 * cp - topo.cp_rank) * c] = o[:, c:]
    ref_out, *ref_grads = reference(q.detach(), k.detach(), v.detach(), dout, True, scale)
    for name, got, want in [("out", out, ref_out), *zip(("dq", "dk", "dv"), grads, ref_grads)]:
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")



class LoopbackCollectives:
    """``StartedCollectives`` for one simulated rank of cp on one GPU: the gather returns the whole
    sequence's k/v (known in advance), the reduce-scatter keeps what it was given (this rank's
    slot of it) and remembers it, so the test can add the other ranks' shares of each slot."""

    def __init__(self, size: int, rank: int, gathered: torch.Tensor):
        self.size, self.rank, self.gathered, self.sent = size, rank, gathered, None

    def start_gather(self, local):
        return self.gathered

    def finish_gather(self, pending):
        return pending

    def start_reduce_scatter(self, full):
        self.sent = full
        return full.chunk(self.size)[self.rank]

    def finish_reduce_scatter(self, pending):
        return pending


@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_attention_with_own_block_first_equals_full_attention(cp):
    """``AllGatherAttention`` (the user's path of ``cp_comm_type = "all_gather"``) on the fused
    kernels, every rank simulated on one GPU: the own block's pieces from the local k/v before
    the gather is waited on; the other blocks' dK/dV reduce-scattered and the own block's added
    after. The reduce-scatter's sum over ranks is the test's (each simulated rank's collectives
    keep their own slot); everything else is the function's. Eager only: the loopback's record
    of what it was sent is a side effect dynamo refuses inside an autograd.Function (the compiled
    pieces are ``attention_over_gathered``'s test above; the compiled collectives, gloo's
    test_compile cp2_allgather)."""
    from mtl.parallel.context_parallel import split_for_context_parallel
    from mtl.parallel.context_parallel.all_gather_attention import AllGatherAttention
    from mtl.parallel.topology import Topology

    q, k, v, dout = _gqa_inputs(seed=3)
    groups, scale = k.size(2), D**-0.5
    kernel = fused_kernel(q.device, q.dtype, D)
    ranks = [Topology(cp=cp, rank=r) for r in range(cp)]
    local = [torch.stack([split_for_context_parallel(t.detach(), 1, topo) for t in (k, v)], dim=1)
             .transpose(0, 2).contiguous().requires_grad_() for topo in ranks]  # [s_local, 2, b, groups, d]
    gathered = torch.cat([t.detach() for t in local], dim=0)
    comms = [LoopbackCollectives(cp, r, gathered) for r in range(cp)]
    attend = AllGatherAttention.apply
    q_local = [split_for_context_parallel(q.detach(), 1, topo).requires_grad_() for topo in ranks]
    outs = [attend(q_local[r], local[r], comms[r], True, scale, kernel) for r in range(cp)]
    for r, topo in enumerate(ranks):
        outs[r].backward(split_for_context_parallel(dout, 1, topo))
    s_local = S // cp
    for r in range(cp):  # the reduce-scatter's sum: the other ranks' dK/dV for rank r's keys
        for j in range(cp):
            if j != r:
                local[r].grad += comms[j].sent[r * s_local:(r + 1) * s_local]
    c = S // (2 * cp)
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dkv = torch.empty(B, S, 2, groups, D, device="cuda", dtype=torch.bfloat16)
    for r in range(cp):  # back to sequence order: rank r holds chunks r and 2cp-1-r
        first, second = slice(r * c, (r + 1) * c), slice((2 * cp - 1 - r) * c, (2 * cp - r) * c)
        for full, part in ((out, outs[r].detach()), (dq, q_local[r].grad)):
            full[:, first], full[:, second] = part[:, :c], part[:, c:]
        grad = local[r].grad.permute(2, 0, 1, 3, 4)  # [b, s_local, 2, groups, d]
        dkv[:, first], dkv[:, second] = grad[:, :c], grad[:, c:]
    ref_out, *ref_grads = reference(q.detach(), k.detach(), v.detach(), dout, True, scale)
    got = [("out", out, ref_out), ("dq", dq, ref_grads[0]), ("dk", dkv[:, :, 0], ref_grads[1]),
           ("dv", dkv[:, :, 1], ref_grads[2])]
    for name, value, want in got:
        torch.testing.assert_close(value.double(), want, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")
