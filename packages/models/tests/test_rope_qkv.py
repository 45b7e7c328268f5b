"""``rotary_qkv``: the forward gives the slices + ``apply_rotary`` path's numbers, the one-pass
backward gives autograd's gradient (against float64 autograd of that path) for MHA and GQA, any
positions and non-contiguous incoming gradients, eager and compiled with no graph break; a
``SelfAttention`` layer gives the same loss and gradients with it as with the old path.

The Triton kernel runs on a GPU, or on the CPU through Triton's interpreter:
``TRITON_INTERPRET=1 MTL_TEST_TRITON_INTERPRET=1 pytest -k triton packages/models/tests/test_rope_qkv.py``
(with triton importable)."""

import os

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from mtl.models.gpt import attention as attention_module
from mtl.models.gpt import build_gpt
from mtl.models.gpt import rope_qkv as rq
from mtl.models.gpt.rope import RotaryEmbedding, apply_rotary
from mtl.models.gpt.rope_qkv import rope_qkv_backward, rotary_qkv
from mtl.models.initialization import initialize_parameters


def devices():
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def old_path(qkv, cos, sin):
    """SelfAttention's path before rotary_qkv: slices, batch-first, apply_rotary."""
    s, b, groups, slots, d = qkv.shape
    hpg = slots - 2
    query = qkv[:, :, :, :hpg].reshape(s, b, groups * hpg, d).transpose(0, 1)
    key, value = qkv[:, :, :, hpg].transpose(0, 1), qkv[:, :, :, hpg + 1].transpose(0, 1)
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value


def tables(b, s, d, device):
    """cos/sin of positions shifted per batch row (as packed or context-parallel inputs)."""
    positions = torch.arange(s, device=device) + 5 * torch.arange(b, device=device)[:, None]
    return RotaryEmbedding(d, 100.0).to(device)(positions)


def strided(shape, dtype, device):
    """A random tensor of ``shape`` [b, s, heads, d] whose strides are not contiguous ones:
    stored [heads, s, b, 2d] and every other element of d taken."""
    b, s, heads, d = shape
    return torch.randn(heads, s, b, 2 * d, device=device).to(dtype)[..., ::2].permute(2, 1, 0, 3)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads, groups", [(4, 4), (8, 2)])  # MHA, GQA
def test_forward_and_backward_match_float64_autograd(device, dtype, tol, heads, groups):
    s, b, d = 7, 3, 16
    hpg = heads // groups
    qkv = (2 * torch.randn(s, b, groups, hpg + 2, d, device=device)).to(dtype).requires_grad_(True)
    cos, sin = tables(b, s, d, device)
    outs = rotary_qkv(qkv, cos, sin)
    # the same numbers as the old path, and value a view of qkv (no copy)
    for got, want in zip(outs, old_path(qkv.detach(), cos, sin)):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert outs[2].data_ptr() == qkv[:, :, :, hpg + 1].data_ptr()

    grads = [strided(t.shape, dtype, device) for t in outs]
    assert not any(g.is_contiguous() for g in grads)
    torch.autograd.backward(outs, grads)

    # float64 autograd of the old path, with the tables rounded to dtype as the forward does
    x = qkv.detach().double().requires_grad_(True)
    torch.autograd.backward(old_path(x, cos.to(dtype).double(), sin.to(dtype).double()), [g.double() for g in grads])
    assert qkv.grad.dtype == dtype and qkv.grad.is_contiguous()
    scale = x.grad.abs().max().item()
    assert (qkv.grad.double() - x.grad).abs().max().item() <= tol * scale


def triton_devices():
    cuda = ["cuda"] if torch.cuda.is_available() and rq.triton is not None else []
    interpret = os.environ.get("MTL_TEST_TRITON_INTERPRET") == "1"
    cpu = [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not (interpret and os.environ.get("TRITON_INTERPRET") == "1" and rq.triton is not None),
                reason="the Triton kernel on the CPU needs MTL_TEST_TRITON_INTERPRET=1, TRITON_INTERPRET=1 and triton",
            ),
        )
    ]
    return cpu + cuda


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, groups, d, table_rows",
    # MHA, GQA; heads and d/2 not powers of two (the masks); tables of one row broadcast over b
    [(4, 4, 16, 3), (8, 2, 16, 3), (6, 2, 6, 3), (5, 5, 10, 1)],
)
def test_triton_kernel_matches_the_reference(device, dtype, heads, groups, d, table_rows):
    s, b = 5, 3
    cos, sin = tables(table_rows, s, d, device)
    dq = strided((b, s, heads, d), dtype, device)
    dk = torch.randn(b, groups, s, d, device=device).to(dtype).transpose(1, 2)
    dv = torch.randn(d, b, s, groups, device=device).to(dtype).permute(1, 2, 3, 0)
    assert not any(t.is_contiguous() for t in (dq, dk, dv))
    want = rq._backward_reference(dq, dk, dv, cos, sin)
    got = rq._backward_triton(dq, dk, dv, cos, sin)
    assert got.shape == (s, b, groups, heads // groups + 2, d) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # bf16 rounding: the interpreter rounds fp32 -> bf16 toward zero (the tables too, so
        # sums that cancel differ by an ulp of their terms), GPUs and PyTorch to nearest even
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.parametrize("device", devices())
def test_compiled_without_graph_break_gives_the_eager_gradient(device):
    torch.manual_seed(1)
    s, b, groups, hpg, d = 4, 2, 2, 2, 8
    w = torch.randn(groups * (hpg + 2) * d, 16, device=device, requires_grad=True)
    cos, sin = tables(b, s, d, device)
    mix = [torch.randn(n, device=device) for n in (groups * hpg, groups, groups)]

    def attention_inputs(x):
        qkv = (x @ w.t()).view(s, b, groups, hpg + 2, d)
        q, k, v = rotary_qkv(qkv, cos, sin)
        # weights per head, so each output's gradient differs
        return sum((t * m[:, None]).square().sum() for t, m in zip((q, k, v), mix))

    x = torch.randn(s, b, 16, device=device)
    compiled = torch.compile(attention_inputs, fullgraph=True)  # a graph break raises here
    _, code = run_and_get_code(lambda: compiled(x).backward())
    if device == "cuda":  # inductor's code launches the kernel: no opaque op, no JIT launch per call
        assert "_rope_qkv_backward_kernel" in "\n".join(code)
        assert "mtl.rope_qkv_backward" not in "\n".join(code)
    got = w.grad.clone()
    w.grad = None
    attention_inputs(x).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-5, atol=1e-5)


def test_fake_kernel_matches_the_real_one():
    # the fake (meta) kernel's shape and dtype are the real one's, for compiled graphs
    b, s, heads, groups, d = 2, 3, 6, 2, 4
    cos, sin = tables(b, s, d, "cpu")
    args = [torch.randn(b, s, n, d, dtype=torch.bfloat16) for n in (heads, groups, groups)] + [cos, sin]
    real = rope_qkv_backward(*args)
    fake = rope_qkv_backward(*(t.to("meta") for t in args))
    assert real.shape == fake.shape == (s, b, groups, heads // groups + 2, d) and real.dtype == fake.dtype


def layer_loss_and_grads(make_config, backend, single, groups):
    config = make_config("llama", model={"qk_norm": False, "num_query_groups": groups})
    model = build_gpt(config, single, backend).train()
    initialize_parameters(model, 3, single)
    layer = next(iter(model.layers.values()))
    attention = layer.self_attention
    assert attention.q_norm is None
    s, b = 16, 2
    hidden = torch.randn(s, b, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    positions = torch.arange(s) + 3 * torch.arange(b)[:, None]
    out = attention(hidden, model.rotary(positions))
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum()
    loss.backward()
    grads = {name: p.grad for name, p in attention.named_parameters()}
    return loss.detach(), {"hidden": hidden.grad, **grads}


@pytest.mark.parametrize("groups", [4, 2])  # MHA, GQA
def test_self_attention_gives_the_old_paths_loss_and_gradients(make_config, backend, single, groups, monkeypatch):
    new_loss, new_grads = layer_loss_and_grads(make_config, backend, single, groups)
    monkeypatch.setattr(attention_module, "rotary_qkv", old_path)
    old_loss, old_grads = layer_loss_and_grads(make_config, backend, single, groups)
    torch.testing.assert_close(new_loss, old_loss, rtol=1e-6, atol=0)
    assert new_grads.keys() == old_grads.keys() and len(new_grads) > 1
    for name, grad in old_grads.items():
        torch.testing.assert_close(new_grads[name], grad, rtol=1e-6, atol=1e-6 * grad.abs().max().item(), msg=name)
