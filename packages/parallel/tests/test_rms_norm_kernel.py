"""RMSNorm's Triton path (CUDA) and its dispatch: the CPU path is the old fp32 F.rms_norm formula."""

import pytest
import torch
import torch.nn.functional as F

from mtl.parallel.backend_local import RMSNorm
from mtl.parallel.backend_local import norms as norms_module
from mtl.parallel.backend_local import rms_norm_kernel as K

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
needs_triton = pytest.mark.skipif(not K.HAVE_TRITON, reason="needs triton")


def old_formula(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_the_old_formula_forward_and_backward(x_dtype, w_dtype):
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 5, 48).to(x_dtype).requires_grad_()
    dy = torch.randn(3, 5, 48).to(x_dtype)
    out = norm(x)
    out.backward(dy)
    w_ref = norm.weight.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ref = old_formula(x_ref, w_ref, 1e-6)
    ref.backward(dy)
    assert out.dtype == x_dtype and x.grad.dtype == x_dtype and norm.weight.grad.dtype == w_dtype
    assert torch.equal(out, ref)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(norm.weight.grad, w_ref.grad)


def test_dispatch_chooses_f_rms_norm_on_cpu(monkeypatch):
    x = torch.randn(4, 2, 32)
    w = torch.ones(32)
    assert not K.can_use_triton_rms_norm(x, w)

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton path was taken on CPU")

    monkeypatch.setattr(norms_module, "triton_rms_norm", no_triton)
    norm = RMSNorm(32)
    torch.testing.assert_close(norm(x), old_formula(x, norm.weight, norm.eps), rtol=0, atol=0)


def test_dispatch_routes_to_the_kernel_when_it_applies(monkeypatch):
    calls = []

    def fake_kernel(x, weight, eps):
        calls.append((x.shape, weight.shape, eps))
        return torch.zeros_like(x)

    monkeypatch.setattr(norms_module, "can_use_triton_rms_norm", lambda x, w: True)
    monkeypatch.setattr(norms_module, "triton_rms_norm", fake_kernel)
    out = RMSNorm(16, eps=1e-5)(torch.randn(2, 3, 16))
    assert calls == [((2, 3, 16), (16,), 1e-5)] and torch.all(out == 0)


def test_unsupported_inputs_fall_back():
    w = torch.ones(8)
    assert not K.can_use_triton_rms_norm(torch.randn(2, 8, dtype=torch.float64), w)
    if torch.cuda.is_available():
        big = K.MAX_HIDDEN * 2
        assert not K.can_use_triton_rms_norm(torch.randn(2, big, device="cuda"), torch.ones(big, device="cuda"))
        assert not K.can_use_triton_rms_norm(torch.randn(2, 8, device="cuda", dtype=torch.float64), w.cuda())


def _reference(x, w, dy, eps):
    """fp32 F.rms_norm on the same (rounded) inputs; y and dx cast to x's dtype like the module."""
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    y = F.rms_norm(xr, (x.shape[-1],), wr, eps)
    y.backward(dy.float())
    return y, xr.grad, wr.grad


def _check_against_reference(shape, x_dtype, w_dtype, compiled=False, eps=1e-5):
    torch.manual_seed(0)
    h = shape[-1]
    x = torch.randn(shape, device="cuda").to(x_dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(h, device="cuda")).to(w_dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda").to(x_dtype)
    fn = K.triton_rms_norm
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    y = fn(x, w, eps)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, eps)
    assert y.dtype == x_dtype and x.grad.dtype == x_dtype and w.grad.dtype == w_dtype
    low = x_dtype != torch.float32
    tol = dict(rtol=1.6e-2, atol=1e-2) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), y_ref, **tol)
    torch.testing.assert_close(x.grad.float(), dx_ref, **tol)
    # dweight sums `rows` products in fp32 (another order than the reference)
    w_tol = dict(rtol=1.6e-2, atol=1e-2) if w_dtype != torch.float32 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.grad.float(), dw_ref, **w_tol)
    if low:  # rounded to nearest: equal to the rounded reference but where fp32 noise crosses a tie
        assert (y != y_ref.to(x_dtype)).float().mean().item() < 1e-3


CASES = [
    ((8192, 2048), torch.bfloat16, torch.bfloat16),
    ((8192, 2048), torch.bfloat16, torch.float32),
    ((3, 5, 256), torch.float32, torch.float32),
    ((3, 5, 256), torch.bfloat16, torch.bfloat16),
    ((7, 1000), torch.bfloat16, torch.float32),
    ((33, 2, 1000), torch.float16, torch.bfloat16),
    ((1, 16384), torch.bfloat16, torch.bfloat16),
]


@needs_gpu
@needs_triton
@pytest.mark.parametrize("shape,x_dtype,w_dtype", CASES)
def test_triton_matches_f_rms_norm(shape, x_dtype, w_dtype):
    x = torch.zeros(shape, device="cuda", dtype=x_dtype)
    assert K.can_use_triton_rms_norm(x, torch.ones(shape[-1], device="cuda", dtype=w_dtype))
    _check_against_reference(shape, x_dtype, w_dtype)


@needs_gpu
@needs_triton
@pytest.mark.parametrize("shape,x_dtype,w_dtype", [CASES[0], CASES[4]])
def test_triton_op_compiles_fullgraph(shape, x_dtype, w_dtype):
    _check_against_reference(shape, x_dtype, w_dtype, compiled=True)


@needs_gpu
@needs_triton
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_compiled_module_matches_eager_fallback(w_dtype, monkeypatch):
    torch.manual_seed(0)
    norm = RMSNorm(2048, eps=1e-5).cuda().to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(2048))
    x = torch.randn(512, 2, 2048, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(512, 2, 2048, device="cuda").bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True)
    y = compiled(x)
    y.backward(dy)
    dx, dw = x.grad.clone(), norm.weight.grad.clone()
    assert dw.dtype == w_dtype and y.dtype == torch.bfloat16
    x.grad, norm.weight.grad = None, None
    monkeypatch.setenv("MTL_TRITON_RMSNORM", "0")  # eager, the F.rms_norm path
    assert not K.can_use_triton_rms_norm(x, norm.weight)
    y_ref = norm(x)
    y_ref.backward(dy)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(dx.float(), x.grad.float(), rtol=1.6e-2, atol=1e-2)
    w_tol = dict(rtol=1.6e-2, atol=1e-2) if w_dtype != torch.float32 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(dw.float(), norm.weight.grad.float(), **w_tol)
