"""``swiglu``: the forward is ``silu(gate) * up``, the one-pass backward gives autograd's gradient
(against float64 autograd), on the CPU and, on a GPU, in its Triton kernel, eager and compiled,
with no graph break. The kernel itself also runs on the CPU in Triton's interpreter
(``MTL_TEST_TRITON_INTERPRET=1 TRITON_INTERPRET=1`` with triton importable; tests/test_triton_interpreted.py)."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import mtl.models.swiglu as swiglu_module
from mtl.models.swiglu import swiglu, swiglu_backward


def reference(fc1_out: torch.Tensor, grad: torch.Tensor):
    x = fc1_out.detach().double().requires_grad_(True)
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    out.backward(grad.double())
    return out.detach(), x.grad


def devices():
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_forward_and_backward_match_float64_autograd(device, dtype, tol):
    torch.manual_seed(0)
    # [s, b, 2 * ffn] with ffn not a multiple of the kernel's block (its mask)
    fc1_out = (3 * torch.randn(33, 2, 2 * 1100, device=device)).to(dtype).requires_grad_(True)
    grad = torch.randn(33, 2, 1100, device=device).to(dtype)
    out = swiglu(fc1_out)
    out.backward(grad)
    want_out, want_grad = reference(fc1_out, grad)
    assert out.dtype == dtype and fc1_out.grad.dtype == dtype
    scale = want_grad.abs().max().item()
    assert (out.double() - want_out).abs().max().item() <= tol * want_out.abs().max().item()
    assert (fc1_out.grad.double() - want_grad).abs().max().item() <= tol * scale


@pytest.mark.parametrize("device", devices())
def test_compiled_without_graph_break_gives_the_eager_gradient(device):
    torch.manual_seed(1)
    w = torch.randn(64, 32, device=device, requires_grad=True)

    def mlp(x):
        return swiglu(x @ w.t()).sum(-1)

    x = torch.randn(8, 32, device=device)
    compiled = torch.compile(mlp, fullgraph=True)  # a graph break raises here
    _, code = run_and_get_code(lambda: compiled(x).sum().backward())
    if device == "cuda":  # inductor's code launches the kernel: no opaque op, no JIT launch per call
        assert "_swiglu_backward_kernel" in "\n".join(code)
        assert "mtl.swiglu_backward" not in "\n".join(code)
    got = w.grad.clone()
    w.grad = None
    mlp(x).sum().backward()
    assert torch.allclose(got, w.grad, rtol=1e-5, atol=1e-5)


def test_fake_kernel_matches_the_real_one():
    # the fake (meta) kernel's shape and dtype are the real one's, for compiled graphs
    fc1_out, grad = torch.randn(4, 10, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
    real = swiglu_backward(fc1_out, grad)
    fake = swiglu_backward(fc1_out.to("meta"), grad.to("meta"))
    assert real.shape == fake.shape == fc1_out.shape and real.dtype == fake.dtype


@pytest.mark.parametrize("device", devices())
def test_no_tokens(device):
    # an MoE expert that received none
    fc1_out = torch.randn(0, 2 * 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    swiglu(fc1_out).sum().backward()
    assert fc1_out.grad.shape == (0, 96)


@pytest.mark.skipif(not (os.environ.get("MTL_TEST_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
                         and swiglu_module.triton is not None),
                    reason="the Triton kernel on the CPU needs MTL_TEST_TRITON_INTERPRET=1, TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_in_the_interpreter_matches_the_formula(dtype):
    torch.manual_seed(2)
    # ffn 1100: the second block of each row is partly masked; 0 rows: an expert with no tokens
    for rows in (7, 0):
        fc1_out = (3 * torch.randn(rows, 2 * 1100)).to(dtype)
        grad = torch.randn(rows, 1100).to(dtype)
        got = swiglu_module._backward_triton(fc1_out, grad)
        want = swiglu_module._backward_reference(fc1_out, grad)
        assert got.shape == fc1_out.shape and got.dtype == dtype
        # the same fp32 formula rounded once; the interpreter's sigmoid may differ in the last fp32 bits
        torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


def test_eager_backward_skips_the_op_dispatch():
    # eager autograd calls the function directly (the op's custom_op dispatch costs ~40 us per
    # call on a GPU host); compiled graphs go through the op (the compiled test above)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    fc1_out = torch.randn(4, 2 * 8, requires_grad=True)
    out = swiglu(fc1_out)
    with Ops() as ops:
        out.sum().backward()
    assert fc1_out.grad is not None and ops.names
    assert not any("swiglu_backward" in name for name in ops.names), ops.names
