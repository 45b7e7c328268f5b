"""The local backend at one process: registration, norms and core attention vs references."""

import importlib.metadata
import math

import pluggy
import pytest
import torch
import torch.nn.functional as F

from mtl.core import hookspecs
from mtl.core.errors import ConfigError, ParallelError
from mtl.parallel.backend_local import CoreAttention, LayerNorm, RMSNorm
from mtl.parallel.param_layout import param_layout


def local_backend_from_entry_point():
    (ep,) = importlib.metadata.entry_points(group="mtl", name="local_backend")
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(ep.load(), name=ep.name)
    (records,) = pm.hook.mtl_backends()
    return {r.name: r for r in records}["local"]


def test_entry_point_registers_local_backend_with_contract_factories():
    backend = local_backend_from_entry_point()
    torch.manual_seed(0)
    col = backend.column_linear(16, 32, bias=True, init_std=0.02, topology=None)
    row = backend.row_linear(32, 16, bias=False, init_std=0.02, topology=None)
    x = torch.randn(5, 2, 16)  # [s, b, h]
    y = row(col(x))
    assert y.shape == (5, 2, 16)
    torch.testing.assert_close(y, (x @ col.weight.T + col.bias) @ row.weight.T)
    assert [param_layout(p).tp_split_dim for p in (col.weight, col.bias, row.weight)] == [0, 0, 1]
    assert abs(col.weight.std().item() - 0.02) < 0.005 and torch.all(col.bias == 0)
    assert isinstance(backend.norm(16, kind="layernorm", eps=1e-5), LayerNorm)
    attn = backend.core_attention(num_heads=4, num_query_groups=2, head_dim=8, causal=True, dropout=0.0, topology=None)
    assert isinstance(attn, CoreAttention)


def test_unknown_norm_kind_is_a_config_error_naming_the_choices():
    backend = local_backend_from_entry_point()
    with pytest.raises(ConfigError, match="batchnorm.*layernorm.*rmsnorm"):
        backend.norm(16, kind="batchnorm", eps=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_fp32_reference_and_keeps_dtype(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(4, 3, 32).to(dtype)
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    out = norm(x)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=tol, atol=tol)


def test_layernorm_matches_torch_layernorm_forward_and_backward():
    torch.manual_seed(0)
    ours = LayerNorm(32, eps=1e-5)
    ref = torch.nn.LayerNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32))
        ours.bias.copy_(torch.randn(32))
        ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ours(x).pow(2).sum().backward()
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)
    assert ours(x.bfloat16()).dtype == torch.bfloat16


def naive_attention(q, k, v, causal):
    """q [b, s_q, h, d], k/v [b, s_kv, g, d]; query head i reads K/V group i // (h/g)."""
    b, s_q, h, d = q.shape
    s_kv, g = k.shape[1], k.shape[2]
    group_of_head = torch.arange(h) // (h // g)
    k = k[:, :, group_of_head]  # [b, s_kv, h, d]
    v = v[:, :, group_of_head]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if causal:
        q_pos = torch.arange(s_kv - s_q, s_kv).unsqueeze(1)  # queries are the last s_q positions
        scores = scores.masked_fill(torch.arange(s_kv).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_core_attention_matches_naive_softmax_attention_with_gqa(heads, groups, causal):
    torch.manual_seed(0)
    q = torch.randn(2, 7, heads, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, groups, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 7, groups, 8, dtype=torch.float64, requires_grad=True)
    attn = CoreAttention(num_heads=heads, num_query_groups=groups, head_dim=8, causal=causal, dropout=0.0)
    out = attn(q, k, v)
    ref = naive_attention(q, k, v, causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("s_q", [1, 3])
def test_core_attention_with_shorter_query_attends_as_the_last_positions(s_q):
    """Decoding with a KV cache: queries are the last s_q of s_kv positions."""
    torch.manual_seed(0)
    q = torch.randn(1, s_q, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    attn = CoreAttention(num_heads=4, num_query_groups=2, head_dim=8, causal=True, dropout=0.0)
    torch.testing.assert_close(attn(q, k, v), naive_attention(q, k, v, True), rtol=1e-10, atol=1e-10)


def test_core_attention_dropout_only_in_training():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    attn = CoreAttention(num_heads=2, num_query_groups=2, head_dim=8, causal=True, dropout=0.5)
    attn.eval()
    torch.testing.assert_close(attn(q, k, v), naive_attention(q, k, v, True), rtol=1e-5, atol=1e-6)
    attn.train()
    assert not torch.allclose(attn(q, k, v), naive_attention(q, k, v, True), atol=1e-3)


def test_core_attention_rejects_heads_not_multiple_of_groups():
    with pytest.raises(ParallelError, match="num_heads = 6.*num_query_groups = 4"):
        CoreAttention(num_heads=6, num_query_groups=4, head_dim=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("s_q", [16, 3])
def test_core_attention_bf16_on_gpu_matches_fp32_reference(s_q):
    torch.manual_seed(0)
    q = torch.randn(2, s_q, 8, 64, device="cuda")
    k = torch.randn(2, 16, 2, 64, device="cuda")
    v = torch.randn(2, 16, 2, 64, device="cuda")
    attn = CoreAttention(num_heads=8, num_query_groups=2, head_dim=64, causal=True, dropout=0.0)
    out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (2, s_q, 8, 64)
    ref = naive_attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), True)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)
    norm = RMSNorm(64).cuda()
    x = torch.randn(4, 2, 64, device="cuda")
    ref_norm = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x).double(), ref_norm, rtol=1e-5, atol=1e-5)


def test_tp_split_attention_dropout_without_seeded_stream_names_seed_everything():
    from mtl.parallel.random import get_rng_tracker, seed_everything
    from mtl.parallel.topology import Topology

    get_rng_tracker().reset()
    attn = CoreAttention(num_heads=2, num_query_groups=1, head_dim=8, dropout=0.1, topology=Topology(tp=2))
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(ParallelError, match="seed_everything"):
        attn(q, k, v)
    attn.eval()  # no dropout at evaluation: no stream needed
    assert attn(q, k, v).shape == (1, 4, 2, 8)
    seed_everything(0, device="cpu")
