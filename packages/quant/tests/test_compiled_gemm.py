"""An FP8 layer under torch.compile, its GEMMs (the ``mtl::fp8_gemm`` op) inside the graph:
one graph (fullgraph), and the same output and gradients as eager, for the per-tensor and
row-wise recipes. On CPU; tests/gpu/test_fp8.py checks the same on CUDA."""

import pytest
import torch

from mtl.core.registrations import Fp8Settings
from mtl.quant.layers import Fp8ColumnParallelLinear
from mtl.quant.weight_cache import invalidate_weight_caches


def run(layer, x, dy, compiled: bool):
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    layer.weight.grad = None
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_compiled_gemms_equal_eager(recipe):
    torch.manual_seed(0)
    fp8 = Fp8Settings(recipe, format="e4m3" if recipe == "rowwise" else "hybrid")
    layer = Fp8ColumnParallelLinear(32, 48, fp8=fp8, bias=False).to(torch.bfloat16)
    x = torch.randn(8, 2, 32, dtype=torch.bfloat16)
    dy = torch.randn(8, 2, 48, dtype=torch.bfloat16)
    torch._dynamo.reset()
    eager = run(layer, x, dy, compiled=False)
    # The eager call filled the weight cache: without this the compiled graph would only read
    # it, and W's amax, quantization and transpose would never run compiled.
    invalidate_weight_caches()
    refreshed = run(layer, x, dy, compiled=True)  # fullgraph: a graph break would raise
    reused = run(layer, x, dy, compiled=True)  # the cache the compiled refresh built
    for compiled in (refreshed, reused):
        for name, a, b in zip(("y", "dx", "dW"), eager, compiled):
            assert b is not None, name
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-2 * a.float().abs().max().item(),
                                       msg=name)
