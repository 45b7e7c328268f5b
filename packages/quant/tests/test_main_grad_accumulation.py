"""The FP8 weight-gradient GEMM adds into ``main_grad`` (mtl.parallel's gradient-accumulation
fusion; ``scaled_matmul.scaled_mm_accumulate``, cuBLASLt's epilogue on a GPU).

bf16 weights in DataParallel with fp32 gradient buffers, two micro-batches: the FP8 linears
claim their weights, and each ``main_grad`` is the fp32 sum of the dequantized products
``dyᵀ x``, with no bf16 rounding of each micro-batch's gradient (which the unfused path has,
and this test sees). On a GPU the cuBLASLt call is checked against ``torch._scaled_mm``'s
product added in fp32, at an unaligned ``main_grad`` and inside a CUDA graph."""

import pytest
import torch
from torch import nn

from mtl.core.registrations import Fp8Settings
from mtl.parallel.ddp import DataParallel
from mtl.parallel.tensor_parallel.wgrad_fusion import enable_wgrad_fusion
from mtl.parallel.topology import Topology
from mtl.quant.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from mtl.quant.scaling import E4M3, E5M2, quantize, scale_from_amax


class Pair(nn.Module):
    def __init__(self, recipe: str):
        super().__init__()
        torch.manual_seed(0)
        fp8 = Fp8Settings(recipe, "e4m3" if recipe == "rowwise" else "hybrid")
        self.fc1 = Fp8ColumnParallelLinear(32, 64, fp8=fp8, bias=True, init_std=0.05)
        self.fc2 = Fp8RowParallelLinear(64, 32, fp8=fp8, bias=False, init_std=0.05)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def micro_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2)]


def accumulate(recipe: str, fused: bool, compiled: bool = False) -> Pair:
    module = Pair(recipe).to(torch.bfloat16)
    if fused:
        assert enable_wgrad_fusion(module) == 2  # both FP8 weights; the bias keeps the hook
    model = DataParallel(module, Topology.single(), grad_dtype=torch.float32, bucket_size_mb=1e-4)
    forward = torch.compile(module, fullgraph=True) if compiled else module
    model.zero_grad()
    first, last = micro_batches()
    with model.no_sync():
        forward(first).float().square().sum().backward()
    forward(last).float().square().sum().backward()
    model.finish_grad_sync()
    return module


def dequant(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    a = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()
    scale = scale_from_amax(a.float(), dtype)
    return quantize(t, scale, dtype).float() * scale


def fp32_weight_grads(module: Pair, recipe: str) -> dict[str, torch.Tensor]:
    """Each micro-batch's FP8 weight-gradient product, dequantized and summed in fp32, from the
    activations and output gradients the module itself saw (captured by hooks)."""
    rowwise, grad_dtype = recipe == "rowwise", (E4M3 if recipe == "rowwise" else E5M2)
    seen = {name: [] for name in ("fc1", "fc2")}  # name -> [(x, dy)] per micro-batch

    def record(name):
        def hook(_module, args, out):
            entry = [args[0].detach()]
            seen[name].append(entry)
            out.register_hook(lambda grad: entry.append(grad.detach()))  # the GEMM's dy (the bias adds after it)
        return hook

    hooks = [getattr(module, name).register_forward_hook(record(name)) for name in seen]
    for x in micro_batches():
        module(x).float().square().sum().backward()
    for h in hooks:
        h.remove()
    total = {}
    for name, calls in seen.items():
        for x, dy in calls:
            x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
            product = dequant(dy2.t(), grad_dtype, rowwise) @ dequant(x2.t(), E4M3, rowwise).t()
            total[name] = total.get(name, 0) + product
    return total


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_fused_main_grad_is_the_fp32_sum_of_the_fp8_products(recipe):
    fused = accumulate(recipe, fused=True)
    unfused = accumulate(recipe, fused=False)
    reference = fp32_weight_grads(Pair(recipe).to(torch.bfloat16), recipe)
    for name in ("fc1", "fc2"):
        weight, ref = getattr(fused, name).weight, reference[name]
        assert weight.grad is None and getattr(weight, "wgrad_fused", False)
        fused_err = ((weight.main_grad - ref).abs().max() / ref.abs().max()).item()
        unfused_err = ((getattr(unfused, name).weight.main_grad - ref).abs().max() / ref.abs().max()).item()
        assert fused_err < 1e-5, (name, fused_err)
        assert unfused_err > 10 * fused_err, (name, fused_err, unfused_err)  # bf16 rounding per micro-batch
    # the bias keeps the hook's path: the same in both runs
    assert torch.equal(fused.fc1.bias.main_grad, unfused.fc1.bias.main_grad)


def test_fused_under_compile_is_one_graph_and_the_unfused_sum():
    """Compiled, fused against compiled, unfused: the same compiled forward, so the two
    differ only by the unfused path's bf16 rounding of each micro-batch's gradient. (Against
    eager they may differ more: a compiled tanh can put an element of ``dy`` on the other side
    of an e5m2 rounding step, a 12-25% change of that element, on fused and unfused alike.)"""
    torch._dynamo.reset()
    fused = accumulate("current", fused=True, compiled=True)  # fullgraph: a graph break raises
    unfused = accumulate("current", fused=False, compiled=True)
    for name in ("fc1", "fc2"):
        a, b = getattr(unfused, name).weight.main_grad, getattr(fused, name).weight.main_grad
        assert getattr(getattr(fused, name).weight, "wgrad_fused", False)
        assert ((b - a).norm() / a.norm()).item() < 1e-2, name


def test_enabled_without_a_main_grad_or_without_grad_mode_keeps_autograds_gradient():
    """Switched on but outside DataParallel (no ``main_grad``), the weight gradient is autograd's,
    not dropped; and a no-grad forward of a fused layer gives the unfused layer's output."""
    fused, plain = Pair("current").to(torch.bfloat16), Pair("current").to(torch.bfloat16)
    assert enable_wgrad_fusion(fused) == 2
    x = micro_batches()[0]
    fused(x).float().square().sum().backward()
    plain(x).float().square().sum().backward()
    for name in ("fc1", "fc2"):
        grad, expected = getattr(fused, name).weight.grad, getattr(plain, name).weight.grad
        assert grad is not None and torch.equal(grad, expected), name
    with torch.no_grad():
        assert torch.equal(fused(x), plain(x))


def test_the_trainer_fuses_the_fp8_weights_and_trains_as_without(monkeypatch):
    """The user's path: ``mtl train``'s loop with bf16 weights switches the fusion on for every
    FP8 linear, and its losses follow those of the same run with the hook's adds instead."""
    from mtl.core.config_io import load_config
    from mtl.quant.layers import Fp8Gemm
    from mtl.train import setup as train_setup
    from mtl.train.loop import train
    from mtl.train.testing import TINY

    overrides = [*TINY, "model.backend='fp8'", "train.fp8='current'", "train.precision='bf16'", "train.iters=4"]
    fused = train(load_config(None, overrides), progress=False)
    layers = [m for chunk in fused.run.chunks for m in chunk.modules() if isinstance(m, Fp8Gemm)]
    assert len(layers) == 4 * 4  # qkv, proj, fc1, fc2 in each of the 4 layers
    assert all(layer.accumulates_main_grad and layer.weight.wgrad_fused for layer in layers)
    monkeypatch.setattr(train_setup, "enable_wgrad_fusion", lambda module: 0)
    unfused = train(load_config(None, overrides), progress=False)
    assert not any(getattr(m, "accumulates_main_grad", False) for chunk in unfused.run.chunks for m in chunk.modules())
    assert sorted(fused.losses) == sorted(unfused.losses) == [1, 2, 3, 4]
    for step in fused.losses:  # the fused sum skips a bf16 rounding per micro-batch: close, not equal
        assert fused.losses[step] == pytest.approx(unfused.losses[step], rel=1e-4), (fused.losses, unfused.losses)


needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="cuBLASLt FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer")


def operands(n, m, k, b_dtype, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    a = (torch.randn(n, k, device=device, generator=g) * 3).to(E4M3)
    b = (torch.randn(m, k, device=device, generator=g) * 5).to(b_dtype)
    sa = torch.tensor(0.25, device=device)
    sb = torch.tensor(1.5, device=device)
    return a, sa, b, sb


@needs_fp8_gpu
@pytest.mark.parametrize("b_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("offset", [0, 4, 1], ids=["aligned", "offset16B", "offset4B"])
def test_the_accumulating_gemm_adds_the_scaled_product(b_dtype, offset):
    """cuBLASLt where it takes the operands, the add path where the buffer is not 16-byte
    aligned (a main_grad view after a parameter of odd size): the same sum either way."""
    from mtl.quant.cublaslt import accepts
    from mtl.quant.scaled_matmul import scaled_mm_accumulate

    n, m, k = 96, 160, 512
    a, sa, b, sb = operands(n, m, k, b_dtype)
    buffer = torch.randn(offset + n * m + 8, device="cuda")
    out = buffer[offset:offset + n * m].view(n, m)  # a view into a flat buffer, as main_grad is
    start, outside = out.clone(), torch.cat([buffer[:offset], buffer[offset + n * m:]])
    product = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    scaled_mm_accumulate(out, a, sa, b, sb)
    torch.testing.assert_close(out, start + product, rtol=1e-6, atol=1e-5)
    scaled_mm_accumulate(out, a, sa, b, sb)
    torch.testing.assert_close(out, start + 2 * product, rtol=1e-6, atol=1e-5)
    assert accepts(out, a, sa, b, sb) is (offset % 4 == 0)  # 16 bytes: cuBLASLt's FP8 minimum
    assert torch.cat([buffer[:offset], buffer[offset + n * m:]]).equal(outside)  # nothing written outside the view


@needs_fp8_gpu
def test_cublaslt_accumulate_replays_in_a_cuda_graph():
    from mtl.quant.cublaslt import fp8_gemm_accumulate

    a, sa, b, sb = operands(64, 128, 256, E5M2)
    out = torch.zeros(64, 128, device="cuda")
    fp8_gemm_accumulate(out, a, sa, b, sb)  # warm-up: the plan and the workspace exist before capture
    product = out.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fp8_gemm_accumulate(out, a, sa, b, sb)
    torch.cuda.current_stream().wait_stream(stream)
    out.zero_()
    for _ in range(3):
        graph.replay()
    torch.testing.assert_close(out, 3 * product, rtol=1e-6, atol=1e-5)
    sa.fill_(0.5)  # the scale is read from its tensor at each replay
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, 2 * product, rtol=1e-6, atol=1e-5)


@needs_fp8_gpu
def test_fast_accumulation_forward_stays_within_fp8_precision():
    from mtl.quant.scaled_matmul import scaled_mm

    a, sa, b, sb = operands(256, 512, 4096, E4M3)
    exact = scaled_mm(a, sa, b, sb, torch.float32, False)
    fast = scaled_mm(a, sa, b, sb, torch.float32, True)
    reference = (a.double() * sa.double()) @ (b.double() * sb.double()).t()

    def error(y):
        return ((y.double() - reference).norm() / reference.norm()).item()

    # measured on an H100 (torch 2.11): 1.3e-4 exact, 1.3e-3 fast at K = 4096; e4m3's own
    # rounding of each operand is ~3% per element, so neither is what limits FP8 training
    assert error(exact) < 5e-4
    assert error(exact) < error(fast) < 5e-3  # the flag reaches the kernel
