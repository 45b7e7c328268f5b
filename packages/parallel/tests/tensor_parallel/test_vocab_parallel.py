"""Vocab-parallel embedding and cross-entropy at tp=2 equal full-vocabulary references."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtl.core.errors import ParallelError
from mtl.parallel.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import param_layout

TOL = dict(rtol=1e-6, atol=1e-6)
V, H, B, S = 32, 16, 2, 6


def gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    shards = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, t.contiguous(), group=group)
    return torch.cat(shards, dim=dim)


def embedding_equivalence(sequence_parallel: bool, device: str):
    topo = Topology.build(tp=2)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (B, S), generator=g)
    tokens[0, :3] = torch.tensor([0, V // 2 - 1, V - 1])  # the edges of both ranks' ranges
    dy = torch.randn(S, B, H, generator=g)
    table, tokens, dy = table.to(device), tokens.to(device), dy.to(device)

    ref_table = table.clone().requires_grad_()
    ref = F.embedding(tokens.t(), ref_table)  # [s, b, h]
    ref.backward(dy)

    emb = VocabParallelEmbedding(V, H, topology=topo, sequence_parallel=sequence_parallel, device=device)
    emb.load_full(table)
    assert emb.weight.shape == (V // 2, H) and param_layout(emb.weight).tp_split_dim == 0
    out = emb(tokens)
    if sequence_parallel:
        assert out.shape == (S // 2, B, H)
        out.backward(dy.chunk(2, dim=0)[topo.tp_rank])
        out = gather_dim(out, 0, topo.tp_group)
    else:
        assert out.shape == (S, B, H)
        out.backward(dy)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(gather_dim(emb.weight.grad, 0, topo.tp_group), ref_table.grad, **TOL)


def cross_entropy_equivalence(layout: str, dtype: torch.dtype, device: str):
    topo = Topology.build(tp=2)
    g = torch.Generator().manual_seed(1)
    shape = (S, B) if layout == "sbv" else (B, S)
    logits = (torch.randn(*shape, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, shape, generator=g)
    target.view(-1)[:3] = torch.tensor([0, V // 2, V - 1])
    weights = torch.rand(*shape, generator=g)  # a loss mask-like weighting of tokens
    logits, target, weights = logits.to(device), target.to(device), weights.to(device)

    ref_logits = logits.detach().double().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V), target.reshape(-1), reduction="none").view(shape)
    (ref_loss * weights).sum().backward()

    local = logits.chunk(2, dim=-1)[topo.tp_rank].clone().requires_grad_()  # [..., V/tp]
    loss = vocab_parallel_cross_entropy(local, target, topo)
    assert loss.dtype == torch.float32 and loss.shape == shape
    (loss * weights).sum().backward()
    assert local.grad.dtype == dtype
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **tol)
    grad = gather_dim(local.grad, -1, topo.tp_group).double()
    torch.testing.assert_close(grad, ref_logits.grad, **tol)


def padded_cross_entropy_equivalence(vocab_size: int, device: str):
    """Columns past ``vocab_size`` hold large junk: the loss and gradients must be those of
    the true vocabulary alone, and the padding's gradient exactly zero."""
    topo = Topology.build(tp=2)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(S, B, V, generator=g)
    logits[..., vocab_size:] = 50.0 + torch.randn(S, B, V - vocab_size, generator=g)
    target = torch.randint(0, vocab_size, (S, B), generator=g)
    logits, target = logits.to(device), target.to(device)

    ref_logits = logits[..., :vocab_size].detach().double().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab_size), target.reshape(-1), reduction="none").view(S, B)
    ref_loss.sum().backward()

    local = logits.chunk(2, dim=-1)[topo.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, topo, vocab_size=vocab_size)
    loss.sum().backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **TOL)
    grad = gather_dim(local.grad, -1, topo.tp_group).double()
    torch.testing.assert_close(grad[..., :vocab_size], ref_logits.grad, **TOL)
    assert torch.count_nonzero(grad[..., vocab_size:]) == 0


def all_cases(device: str = "cpu"):
    for sequence_parallel in (False, True):
        embedding_equivalence(sequence_parallel, device)
    for layout in ("sbv", "bsv"):
        cross_entropy_equivalence(layout, torch.float32, device)
    cross_entropy_equivalence("sbv", torch.bfloat16, device)
    padded_cross_entropy_equivalence(V // 2 + 5, device)  # rank 1: 5 real columns, the rest padding
    padded_cross_entropy_equivalence(V // 2 - 3, device)  # rank 1: padding only
    return "ok"


def test_vocab_parallel_embedding_and_cross_entropy_at_tp2_equal_full_vocab():
    assert run_distributed(all_cases, world_size=2) == ["ok", "ok"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_vocab_parallel_at_tp2_on_gpus_with_nccl():
    assert run_distributed(all_cases, world_size=2, args=("cuda",), backend="nccl") == ["ok", "ok"]


def test_cross_entropy_single_process_matches_torch_and_passes_gradcheck():
    torch.manual_seed(0)
    logits = torch.randn(S, B, V, dtype=torch.float64) * 5
    target = torch.randint(0, V, (S, B))
    loss = vocab_parallel_cross_entropy(logits, target, None)
    ref = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.view(S, B), rtol=1e-12, atol=1e-12)
    assert vocab_parallel_cross_entropy(logits.float(), target).dtype == torch.float32
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy(x, target[:2, :1], None),
        (torch.randn(2, 1, V, dtype=torch.float64, requires_grad=True),),
    )


def test_cross_entropy_rejects_mismatched_target_layout():
    with pytest.raises(ParallelError, match=r"target shape \(2, 6\).*\(6, 2\)"):
        vocab_parallel_cross_entropy(torch.randn(S, B, V), torch.zeros(B, S, dtype=torch.long))


def test_embedding_single_process_is_a_plain_lookup_in_sequence_first_layout():
    emb = VocabParallelEmbedding(V, H)
    tokens = torch.randint(0, V, (B, S))
    torch.testing.assert_close(emb(tokens), emb.weight[tokens].transpose(0, 1))
