"""The FP8 weight cache (``weight_cache.py``): the weight is quantized once per optimizer step,
and everything equals the uncached path bit for bit, through the trainer (gradient
accumulation, optimizer steps in between, tp=2), after every kind of weight change, and under
torch.compile (one graph per variant, no recompile per call or step)."""

import pytest
import torch

from mtl.core.registrations import Fp8Settings
from mtl.quant import layers as fp8_layers
from mtl.quant.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from mtl.quant.weight_cache import invalidate_weight_caches, weight_caching
from mtl.train.testing import LAYOUTS, run_tiny

FP8 = ["model.backend='fp8'"]
RECIPES = {"current": [*FP8, "train.fp8='current'"], "rowwise": [*FP8, "train.fp8='rowwise'", "train.fp8_format='e4m3'"]}


@pytest.fixture
def count_refreshes(monkeypatch):
    """How many times a layer quantized its weight for the cache."""
    calls = []
    original = fp8_layers.quantize_weight

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8_layers, "quantize_weight", counting)
    return calls


def trained(overrides, cache: bool):
    """A tiny training run whose FP8 layers are built with (or without) the weight cache."""
    with weight_caching(cache):
        return run_tiny(overrides)


def assert_same_run(cached, uncached):
    assert cached["losses"] == uncached["losses"]
    assert cached["grads"].keys() == uncached["grads"].keys()
    for name, grad in uncached["grads"].items():
        assert torch.equal(cached["grads"][name], grad), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_training_equals_uncached_bitwise(count_refreshes, recipe, precision):
    """3 steps of 4 micro-batches each (TINY: global batch 8, micro-batch 2): a cache kept
    stale across an optimizer step would change steps 2 and 3 and the last gradients. bf16:
    bf16 weights written by the optimizer's main -> model copy (no version bump)."""
    overrides = [*RECIPES[recipe]]
    if precision == "bf16":
        overrides += ["train.precision='bf16'", "train.params_dtype='bf16'"]
    cached = trained(overrides, cache=True)
    refreshes = len(count_refreshes)
    uncached = trained(overrides, cache=False)
    assert len(count_refreshes) == refreshes  # the uncached path never builds a cache
    assert_same_run(cached, uncached)
    linears = 4 * 4  # 4 layers x (qkv, proj, fc1, fc2)
    assert refreshes == 3 * linears, "one quantization per weight and optimizer step"


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tp2_equals_uncached_bitwise(recipe):
    """The refresh all-reduces the weight amax over TP like the uncached path (each spawned rank
    builds its layers with or without the cache)."""
    from mtl.parallel.testing import run_distributed

    world, overrides = LAYOUTS["tp2"]
    cached, uncached = (run_distributed(trained, world, args=([*overrides, *RECIPES[recipe]], cache))
                        for cache in (True, False))
    for rank_cached, rank_uncached in zip(cached, uncached):
        assert_same_run(rank_cached, rank_uncached)


# ---- one layer against its uncached twin -------------------------------------------------


def twins(recipe="current", cls=Fp8ColumnParallelLinear):
    """The same layer with and without the cache (same weights)."""
    fp8 = Fp8Settings(recipe, "e4m3" if recipe == "rowwise" else "hybrid")
    torch.manual_seed(0)
    cached = cls(32, 24, fp8=fp8, bias=False, init_std=0.1)
    with weight_caching(False):
        plain = cls(32, 24, fp8=fp8, bias=False)
    plain.load_state_dict(cached.state_dict())
    assert cached.weight_cache is not None and plain.weight_cache is None
    return cached, plain


def outputs(layer, x, dy=None):
    """y, and with ``dy`` also dx and dW."""
    x = x.clone().requires_grad_(dy is not None)
    layer.weight.grad = None
    y = layer(x)
    if dy is None:
        return (y.detach(),)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


def assert_twins_agree(cached, plain, x, dy=None):
    for a, b in zip(outputs(cached, x, dy), outputs(plain, x, dy)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("cls", [Fp8ColumnParallelLinear, Fp8RowParallelLinear])
def test_refreshed_after_every_kind_of_weight_change(recipe, cls):
    cached, plain = twins(recipe, cls)
    x, dy = torch.randn(6, 2, 32), torch.randn(6, 2, 24)
    assert_twins_agree(cached, plain, x, dy)
    # an optimizer step (torch AdamW on the parameter itself)
    for layer in (cached, plain):
        optimizer = torch.optim.AdamW(layer.parameters(), lr=0.05)
        layer(x).square().sum().backward()
        optimizer.step()
    assert_twins_agree(cached, plain, x, dy)
    # load_state_dict, of a module holding the layer
    new = {"inner.weight": torch.randn(24, 32)}
    for layer in (cached, plain):
        torch.nn.ModuleDict({"inner": layer}).load_state_dict(new, strict=False)
    assert_twins_agree(cached, plain, x, dy)
    # an in-place edit, and a write that bypasses the version counter (``.data``): the latter
    # needs invalidate_weight_caches() (the trainer's writes are all followed by an optimizer step)
    for layer in (cached, plain):
        with torch.no_grad():
            layer.weight.mul_(0.5)
    assert_twins_agree(cached, plain, x, dy)
    for layer in (cached, plain):
        layer.weight.data.mul_(3.0)
    invalidate_weight_caches()
    assert_twins_agree(cached, plain, x, dy)
    # evaluation, no_grad, inference_mode (the latter leaves the cache alone)
    for layer in (cached, plain):
        layer.eval()
    with torch.no_grad():
        assert_twins_agree(cached, plain, x)
    with torch.inference_mode():
        assert_twins_agree(cached, plain, x)
    # a dtype change
    cached, plain = cached.train().to(torch.bfloat16), plain.train().to(torch.bfloat16)
    assert_twins_agree(cached, plain, x.bfloat16(), dy.bfloat16())


def test_micro_batches_share_one_quantization(count_refreshes):
    cached, _ = twins("current")
    optimizer = torch.optim.AdamW(cached.parameters(), lr=0.05)
    for step in range(3):
        for _ in range(4):
            cached(torch.randn(6, 2, 32)).sum().backward()
        optimizer.step()
        assert len(count_refreshes) == step + 1
    assert cached.weight_cache.stale and cached.weight_cache.value is None  # freed until the next forward


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kept_in_place_for_cuda_graphs(recipe):
    """train.cuda_graphs: a captured forward reads the FP8 copy's addresses, so after an
    optimizer step the copy is refreshed into the same tensors (before_graph_replay), and a
    layer then computes what the uncached one does."""
    cached, plain = twins(recipe)
    cached.before_graph_capture()
    x, dy = torch.randn(6, 2, 32), torch.randn(6, 2, 24)
    assert_twins_agree(cached, plain, x, dy)
    held = [t for pair in (cached.weight_cache.value.forward, cached.weight_cache.value.backward) for t in pair]
    before = [t.clone() for t in held]
    for layer in (cached, plain):
        optimizer = torch.optim.AdamW(layer.parameters(), lr=0.05)
        layer(x).square().sum().backward()
        optimizer.step()
    assert cached.weight_cache.stale and cached.weight_cache.value is not None  # kept, not freed
    cached.before_graph_replay()
    assert not cached.weight_cache.stale
    now = [t for pair in (cached.weight_cache.value.forward, cached.weight_cache.value.backward) for t in pair]
    assert all(a is b for a, b in zip(now, held))  # the same tensors, new contents
    assert not torch.equal(held[0].float(), before[0].float())
    assert_twins_agree(cached, plain, x, dy)


# ---- under torch.compile -------------------------------------------------------------------


class TwoLinears(torch.nn.Module):
    def __init__(self, recipe):
        super().__init__()
        fp8 = Fp8Settings(recipe, "e4m3" if recipe == "rowwise" else "hybrid")
        self.fc1 = Fp8ColumnParallelLinear(32, 64, fp8=fp8, bias=False, init_std=0.1)
        self.fc2 = Fp8RowParallelLinear(64, 32, fp8=fp8, bias=False, init_std=0.1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train_steps(model, steps=3, micro_batches=2, after_step=None, after_micro_batch=None):
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            loss = model(torch.randn(4, 2, 32)).square().mean()
            loss.backward()
            losses.append(loss.detach())
            if after_micro_batch is not None:
                after_micro_batch()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
    return torch.stack(losses)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compiled_cache_no_graph_break_no_recompile(recipe):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    with weight_caching(False):
        reference = TwoLinears(recipe)
    model = TwoLinears(recipe)
    model.load_state_dict(reference.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break raises
    graphs, fp8_weights = [], []  # (counting calls inside the graph would itself add guards)
    losses = train_steps(compiled, after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]),
                         after_micro_batch=lambda: fp8_weights.append(model.fc1.weight_cache.value.forward[0]))
    # step 1 compiled the refresh variant and the reuse variant; steps 2 and 3 reused both
    assert graphs[0] == graphs[-1] <= 2, graphs
    assert [len({id(w) for w in fp8_weights[i:i + 2]}) for i in (0, 2, 4)] == [1, 1, 1]  # micro-batches share it
    assert len({id(w) for w in fp8_weights}) == 3  # a new one each step
    # the same numbers as the uncached layers compiled the same way
    torch._dynamo.reset()
    expected = train_steps(torch.compile(reference, fullgraph=True))
    torch.testing.assert_close(losses, expected, rtol=0, atol=0)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
