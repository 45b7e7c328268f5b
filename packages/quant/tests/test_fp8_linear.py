"""The FP8 layers against references: each GEMM equals the fp32 product of the dequantized
operands (what the FP8 kernel promises), stays within FP8's precision of the fp32 linear, and
delayed scaling keeps and uses its amax history as documented."""

import pytest
import torch

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.registrations import Fp8Settings
from mtl.quant.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from mtl.quant.scaling import E4M3, E5M2, quantize, scale_from_amax


def dequant(t, dtype, dim=None):
    """Fake-quantize in fp32: per-tensor (dim None) or one scale per row along ``dim``."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = scale_from_amax(a.float(), dtype)
    return quantize(t, scale, dtype).float() * scale


def layer_and_data(recipe, fmt="hybrid", cls=Fp8ColumnParallelLinear, dtype=torch.float32):
    torch.manual_seed(0)
    layer = cls(64, 48, fp8=Fp8Settings(recipe, fmt), bias=True, init_std=0.05).to(dtype)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(8, 4, 64, dtype=dtype, requires_grad=True)  # [s, b, in]
    dy = torch.randn(8, 4, 48, dtype=dtype)
    return layer, x, dy


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_current_scaling_equals_the_dequantized_fp32_product(fmt):
    layer, x, dy = layer_and_data("current", fmt)
    y = layer(x)
    y.backward(dy)
    x2, w, dy2 = x.detach().reshape(32, 64), layer.weight.detach(), dy.reshape(32, 48)
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    xq, wq, dyq = dequant(x2, E4M3), dequant(w, E4M3), dequant(dy2, grad_dtype)
    torch.testing.assert_close(y.detach().reshape(32, 48), xq @ wq.t() + layer.bias.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.reshape(32, 64), dyq @ wq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.weight.grad, dyq.t() @ xq, atol=1e-4, rtol=1e-5)
    # and within FP8's precision of the fp32 linear
    exact = x2 @ w.t() + layer.bias.detach()
    assert ((y.detach().reshape(32, 48) - exact).norm() / exact.norm()).item() < 0.05


def test_rowwise_equals_the_dequantized_fp32_product_per_gemm():
    layer, x, dy = layer_and_data("rowwise", "e4m3", cls=Fp8RowParallelLinear)
    y = layer(x)
    y.backward(dy)
    x2, w, dy2 = x.detach().reshape(32, 64), layer.weight.detach(), dy.reshape(32, 48)
    torch.testing.assert_close(y.detach().reshape(32, 48),
                               dequant(x2, E4M3, 1) @ dequant(w, E4M3, 1).t() + layer.bias.detach(), atol=1e-5, rtol=1e-5)
    # each backward GEMM quantizes its operands along its own contraction dimension
    torch.testing.assert_close(x.grad.reshape(32, 64), dequant(dy2, E4M3, 1) @ dequant(w.t(), E4M3, 1).t(),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.weight.grad, dequant(dy2.t(), E4M3, 1) @ dequant(x2.t(), E4M3, 1).t(),
                               atol=1e-4, rtol=1e-5)


def test_rowwise_keeps_small_rows_that_one_tensor_scale_flushes():
    """A token with an outlier ruins per-tensor scaling for the others; row-wise does not."""
    errors = {}
    for recipe in ("current", "rowwise"):
        layer, x, _ = layer_and_data(recipe)
        with torch.no_grad():
            x[0, 0] *= 1e6  # one outlier token: the others fall below e4m3's smallest step
        y = layer(x).detach()
        exact = torch.nn.functional.linear(x.detach(), layer.weight.detach(), layer.bias.detach())
        errors[recipe] = ((y[1:] - exact[1:]).norm() / exact[1:].norm()).item()
    assert errors["rowwise"] < 0.05 and errors["current"] > 0.2, errors  # the bias survives


def test_delayed_scaling_history():
    settings = Fp8Settings("delayed", "hybrid", amax_history_len=4, amax_compute_algo="max", margin=0)
    layer = Fp8ColumnParallelLinear(16, 16, fp8=settings, bias=False)
    history = layer.fp8_amax_history
    assert history.shape == (3, 4) and not history.requires_grad and not history.any()
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["weight", "fp8_amax_history"]
    amaxes = []
    for scale in (1.0, 3.0, 0.5):
        x = (torch.randn(4, 2, 16) * scale).requires_grad_()
        layer(x).sum().backward()
        amaxes.append(x.detach().abs().max())
    assert torch.equal(history[0, :3], torch.stack(amaxes[::-1]))  # most recent first
    assert history[1, 0] == layer.weight.detach().abs().max()
    assert history[2, 0] == 1.0  # the gradient of sum() is all ones
    # the next call is scaled by the history's max (3.0 * ...), not its own amax
    x = torch.randn(4, 2, 16) * 0.01
    y = layer(x).detach()
    scale_x = scale_from_amax(history[0].max(), E4M3)
    expected = (quantize(x.reshape(8, 16), scale_x, E4M3).float() * scale_x) @ dequant(layer.weight.detach(), E4M3).t()
    # the weight's history max equals its amax here (it did not change): same scale as current
    torch.testing.assert_close(y.reshape(8, 16), expected, atol=1e-6, rtol=1e-5)
    # evaluation does not record
    before = history.clone()
    with torch.no_grad():
        layer.eval()
        layer(x)
    assert torch.equal(history, before)


def test_bf16_weights_under_autocast():
    layer, x, dy = layer_and_data("current", dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    assert layer.weight.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    layer32, x32, _ = layer_and_data("current")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer32(x32).dtype == torch.bfloat16


def resolved(**train):
    config = RunConfig()
    config.model.backend = train.pop("backend")
    for key, value in train.items():
        setattr(config.train, key, value)
    return config.resolve(1, 100)


def test_resolve_checks_the_recipe_against_the_backend():
    assert resolved(backend="fp8", fp8="delayed").train.fp8 == "delayed"
    with pytest.raises(ConfigError, match=r"train.fp8 = 'current' is not a recipe of model.backend = 'local'.*'fp8'"):
        resolved(backend="local", fp8="current")
    with pytest.raises(ConfigError, match=r"train.fp8 = 'blockwise' is not a recipe of model.backend = 'fp8' "
                                          r"\(it has: current, delayed, rowwise\)"):
        resolved(backend="fp8", fp8="blockwise")
    with pytest.raises(ConfigError, match="train.fp8 = 'e5m2' is not one of"):
        resolved(backend="fp8", fp8="e5m2")


@pytest.mark.parametrize("fast", [True, False])
def test_fast_accumulation_goes_from_the_config_to_the_forward_gemm(fast, monkeypatch):
    from mtl.quant import linear_function
    from mtl.quant.scaled_matmul import scaled_mm

    settings = Fp8Settings.from_train_config(resolved(backend="fp8", fp8="current", fp8_fast_accumulation=fast).train)
    layer = Fp8ColumnParallelLinear(16, 16, fp8=settings, bias=False)
    seen = []

    def recording(*args):  # CPU has one accumulation mode: record what the layer asks for
        seen.append(args[5] if len(args) > 5 else False)
        return scaled_mm(*args)

    monkeypatch.setattr(linear_function, "scaled_mm", recording)
    layer(torch.randn(4, 2, 16, requires_grad=True)).sum().backward()
    assert seen == [fast, False, False]  # forward as configured; input and weight gradients exact
    assert ("fast_accumulation" in layer.extra_repr()) is fast


def delayed_run(layer, micro_batches, checkpointed: bool, fn=None):
    """Forward every micro-batch, then their backwards in order (as a pipeline schedule does),
    optionally under activation checkpointing (the backward recomputes each forward)."""
    from torch.utils.checkpoint import checkpoint

    fn = layer if fn is None else fn
    layer.weight.grad = None
    outs = []
    for x in micro_batches:
        x = x.clone().requires_grad_()
        outs.append((x, checkpoint(fn, x, use_reentrant=False) if checkpointed else fn(x)))
    for scale, (x, y) in enumerate(outs, start=1):
        (y * scale).sum().backward()
    return [x.grad for x, _ in outs], layer.weight.grad.clone(), layer.fp8_amax_history.detach().clone()


def delayed_layer():
    settings = Fp8Settings("delayed", "hybrid", amax_history_len=4, amax_compute_algo="max", margin=0)
    torch.manual_seed(0)
    return Fp8ColumnParallelLinear(16, 16, fp8=settings, bias=False)


def test_delayed_recompute_reuses_the_forward_scales():
    """A recomputed forward uses its original forward's scales (the history has moved since)
    and records nothing: checkpointed equals plain, bit for bit, and nothing stays pending."""
    from mtl.quant import delayed

    torch.manual_seed(1)
    steps = [[torch.randn(4, 2, 16) * s for s in (1.0, 5.0, 0.2)] for _ in range(2)]
    results = {}
    for checkpointed in (False, True):
        layer = delayed_layer()
        results[checkpointed] = [delayed_run(layer, mbs, checkpointed) for mbs in steps]
        assert not delayed._pending.get(int(layer.fp8_key))
    for plain, recomputed in zip(results[False], results[True]):
        for a, b in zip(plain[0], recomputed[0]):
            assert torch.equal(a, b)
        assert torch.equal(plain[1], recomputed[1]) and torch.equal(plain[2], recomputed[2])


def test_delayed_compiles_once():
    """Under torch.compile (fullgraph: no graph break) with activation checkpointing: one
    compilation for every call, the same history as eager, gradients within rounding."""
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    steps = [[torch.randn(4, 2, 16) * s for s in (1.0, 5.0, 0.2)] for _ in range(3)]
    eager_layer, compiled_layer = delayed_layer(), delayed_layer()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_layer, fullgraph=True)
    for mbs in steps:
        eager = delayed_run(eager_layer, mbs, checkpointed=True)
        got = delayed_run(compiled_layer, mbs, checkpointed=True, fn=compiled)
        assert torch.equal(eager[2], got[2])  # the amax history
        torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-6)
        for a, b in zip(eager[0], got[0]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.any_torch
def test_rowwise_on_a_cpu_torch_without_it_is_a_clear_error(monkeypatch):
    from mtl.quant import scaled_matmul

    monkeypatch.setattr(scaled_matmul, "CPU_ROWWISE", False)  # as torch 2.11 on CPU
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    scale = torch.ones(16, 1)
    with pytest.raises(RuntimeError, match="train.fp8 = 'rowwise' on CPU needs torch >= 2.13"):
        scaled_matmul.scaled_mm(a, scale, a, scale, torch.float32)
