"""The chunked SSD scan equals the naive recurrence (float64) and its gradients are exact."""

import pytest
import torch

from mtl.models.mamba.dispatch import ssd_scan
from mtl.models.mamba.ssd import ssd_chunked, ssd_naive


def scan_inputs(batch=2, length=11, heads=4, head_dim=3, groups=2, state=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=g, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(batch, length, heads, generator=g, dtype=dtype))
    A = -torch.exp(torch.randn(heads, generator=g, dtype=dtype))
    B = torch.randn(batch, length, groups, state, generator=g, dtype=dtype)
    C = torch.randn(batch, length, groups, state, generator=g, dtype=dtype)
    initial = torch.randn(batch, heads, head_dim, state, generator=g, dtype=dtype)
    return x, dt, A, B, C, initial


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 16])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_scan_equals_the_recurrence(chunk_size, with_initial_state):
    x, dt, A, B, C, initial = scan_inputs()
    initial = initial if with_initial_state else None
    y, state = ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial)
    y_ref, state_ref = ssd_naive(x, dt, A, B, C, initial_state=initial)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=1e-10)


def test_scan_continues_from_a_state():
    """Prefill of the first part, then the rest from its final state: the whole sequence's outputs."""
    x, dt, A, B, C, _ = scan_inputs(length=12)
    y, state = ssd_chunked(x, dt, A, B, C, chunk_size=4)
    y1, s1 = ssd_chunked(x[:, :7], dt[:, :7], A, B[:, :7], C[:, :7], chunk_size=4)
    y2, s2 = ssd_chunked(x[:, 7:], dt[:, 7:], A, B[:, 7:], C[:, 7:], chunk_size=4, initial_state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=0, atol=1e-10)
    torch.testing.assert_close(s2, state, rtol=0, atol=1e-10)


def test_chunked_scan_gradients_pass_gradcheck():
    inputs = [t.requires_grad_() for t in scan_inputs(batch=1, length=5, heads=2, head_dim=2, groups=1, state=2)]

    def scan(x, dt, A, B, C, initial):
        y, state = ssd_chunked(x, dt, A, B, C, chunk_size=2, initial_state=initial)
        return y, state

    assert torch.autograd.gradcheck(scan, inputs, eps=1e-6, atol=1e-8)


def test_cpu_tensors_take_the_pytorch_scan():
    x, dt, A, B, C, initial = scan_inputs()
    y, state = ssd_scan(x, dt, A, B, C, chunk_size=4, initial_state=initial)
    y_ref, state_ref = ssd_chunked(x, dt, A, B, C, chunk_size=4, initial_state=initial)
    assert torch.equal(y, y_ref) and torch.equal(state, state_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA scan needs a GPU")
def test_cuda_kernel_matches_the_chunked_scan_in_bf16():
    from mtl.models.mamba.dispatch import mamba_ssm_kernel

    kernel = mamba_ssm_kernel()
    if kernel is None:
        pytest.skip("mamba-ssm is not installed (pip install mamba-ssm with MAMBA_SKIP_CUDA_BUILD=TRUE)")
    x, dt, A, B, C, initial = (t.float().cuda() for t in scan_inputs(length=256, heads=8, head_dim=64, groups=2, state=64))
    leaves = [t.bfloat16().requires_grad_() for t in (x, B, C)]
    y, state = kernel(leaves[0], dt, A, leaves[1], leaves[2], chunk_size=64, initial_state=initial)
    ref_leaves = [t.clone().requires_grad_() for t in (x, B, C)]
    y_ref, state_ref = ssd_chunked(ref_leaves[0], dt, A, ref_leaves[1], ref_leaves[2], chunk_size=64, initial_state=initial)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(state.float(), state_ref, rtol=2e-2, atol=5e-2)
    grad = torch.randn_like(y_ref)
    y.backward(grad.bfloat16())
    y_ref.backward(grad)
    for ours, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(ours.grad.float(), ref.grad, rtol=5e-2, atol=1e-1)
