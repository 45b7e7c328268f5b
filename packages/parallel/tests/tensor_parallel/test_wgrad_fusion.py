"""Weight-gradient accumulation fused into ``main_grad`` (wgrad_fusion.py).

bf16 weights in DataParallel with fp32 gradient buffers: over two micro-batches the fused
weights' ``main_grad`` must equal the fp32 sum of ``dyᵀ x`` (no per-micro-batch bf16
rounding, which the unfused path has and this test can see), the bias and the unfused
weights keep the hook's path, every bucket still launches its reduction, and under
``torch.compile`` the same numbers come out with no graph break.
"""

import pytest
import torch
from torch import nn

from mtl.parallel.ddp import DataParallel
from mtl.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mtl.parallel.tensor_parallel.wgrad_fusion import enable_wgrad_fusion
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import set_param_layout


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = ColumnParallelLinear(16, 32, bias=True)
        self.fc2 = RowParallelLinear(32, 16, bias=False)
        self.head = ColumnParallelLinear(16, 8, bias=False)

    def forward(self, x):
        return self.head(self.fc2(torch.tanh(self.fc1(x))))


def micro_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 3, 16, generator=g).to(torch.bfloat16) for _ in range(2)]


def fp32_reference(module: Pair) -> dict[str, torch.Tensor]:
    """Each micro-batch's gradients from the same bf16 weights, computed and summed in fp32."""
    ref = Pair()
    ref.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    total = {name: torch.zeros_like(p) for name, p in ref.named_parameters()}
    for x in micro_batches():
        ref.zero_grad()
        ref(x.float()).square().sum().backward()
        for name, p in ref.named_parameters():
            total[name] += p.grad
    return total


def accumulate(fused: bool, compiled: bool) -> tuple[Pair, DataParallel]:
    module = Pair().to(torch.bfloat16)
    if fused:
        assert enable_wgrad_fusion(module) == 3  # every linear's weight; biases keep the hook
    model = DataParallel(module, Topology.single(), grad_dtype=torch.float32, bucket_size_mb=1e-4,
                         overlap_grad_reduce=True)
    forward = torch.compile(model.module) if compiled else model.module
    model.zero_grad()
    first, last = micro_batches()
    with model.no_sync():
        forward(first).float().square().sum().backward()
    forward(last).float().square().sum().backward()
    assert all(b.launched for b in model.buckets)  # every hook still fired: each bucket started its reduction
    model.finish_grad_sync()
    return module, model


def errors_against_reference(module: Pair) -> dict[str, float]:
    ref = fp32_reference(module)
    return {name: ((p.main_grad - ref[name]).abs().max() / ref[name].abs().max()).item()
            for name, p in module.named_parameters()}


def test_fused_main_grad_is_the_fp32_sum_and_finer_than_unfused():
    module, _ = accumulate(fused=True, compiled=False)
    assert all(p.grad is None for p in module.parameters())
    fused = errors_against_reference(module)
    unfused = errors_against_reference(accumulate(fused=False, compiled=False)[0])
    for name in ("fc1.weight", "fc2.weight", "head.weight"):
        # the same sum in fp32 (the activations themselves are bf16 in both runs)
        assert fused[name] < 2e-2, fused
    assert fused["fc1.weight"] < unfused["fc1.weight"] or fused["fc2.weight"] < unfused["fc2.weight"], (fused, unfused)
    # unfused parameters keep the hook's path: bit-identical to the unfused run
    plain, _ = accumulate(fused=False, compiled=False)
    for name in ("fc1.bias",):
        assert torch.equal(dict(module.named_parameters())[name].main_grad, dict(plain.named_parameters())[name].main_grad)


def test_fused_under_compile_equals_eager_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, _ = accumulate(fused=True, compiled=False)
    compiled, _ = accumulate(fused=True, compiled=True)
    assert dict(counters["graph_break"]) == {}
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(a.main_grad, b.main_grad, rtol=1e-2, atol=1e-3, msg=name)


def test_no_fusion_without_a_main_grad():
    module = Pair().to(torch.bfloat16)
    enable_wgrad_fusion(module)
    module(micro_batches()[0]).float().sum().backward()  # no DataParallel: plain autograd grads
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_a_backend_that_overrides_local_linear_is_not_fused(cls):
    class Custom(cls):
        def local_linear(self, x, weight, bias):
            return torch.nn.functional.linear(x, weight, bias)

    assert enable_wgrad_fusion(Custom(8, 8)) == 0


def test_a_weight_tied_to_an_embedding_is_not_fused():
    module = Pair()
    module.embed = nn.Embedding(8, 16)
    module.head.weight = module.embed.weight  # the output layer tied to the word embedding
    assert enable_wgrad_fusion(module) == 2
    assert not getattr(module.head.weight, "wgrad_fused", False)
    stage_copy = Pair()
    set_param_layout(stage_copy.head.weight, shared_embedding=True)  # a last stage's copy, summed with the first's
    assert enable_wgrad_fusion(stage_copy) == 2


def test_fused_loss_accumulates_the_output_layer_into_main_grad():
    """The chunked LM head + loss (linear_cross_entropy) puts each token chunk's weight
    gradient into main_grad: equal to the fp32 sum over micro-batches and chunks."""
    from mtl.parallel.tensor_parallel.linear_cross_entropy import output_layer_cross_entropy

    torch.manual_seed(0)
    head = ColumnParallelLinear(16, 40, bias=False).to(torch.bfloat16)
    ref = ColumnParallelLinear(16, 40, bias=False)
    ref.weight.data.copy_(head.weight.float())
    assert enable_wgrad_fusion(head) == 1
    model = DataParallel(head, Topology.single(), grad_dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(12, 2, 16, generator=g).to(torch.bfloat16), torch.randint(0, 37, (12, 2), generator=g))
               for _ in range(2)]
    model.zero_grad()
    with model.no_sync():
        output_layer_cross_entropy(head, *batches[0], vocab_size=37, chunk_bytes=256).sum().backward()
    output_layer_cross_entropy(head, *batches[1], vocab_size=37, chunk_bytes=256).sum().backward()
    model.finish_grad_sync()
    for hidden, target in batches:
        output_layer_cross_entropy(ref, hidden.float(), target, vocab_size=37).sum().backward()
    assert head.weight.grad is None
    torch.testing.assert_close(head.weight.main_grad, ref.weight.grad, rtol=0, atol=2e-2 * ref.weight.grad.abs().max())
    assert head.weight.main_grad[37:].abs().sum() == 0  # padding rows never get a gradient


class _AddIntoMainGrad(torch.autograd.Function):
    """What a backend module with its own fused backward does (Transformer Engine's
    ``fuse_wgrad_accumulation``): ``main_grad += dyᵀ x`` in fp32, a placeholder to autograd."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(dy.reshape(-1, dy.shape[-1]).float().t() @ x.reshape(-1, x.shape[-1]).float())
        return dy @ weight, torch.empty_like(weight)


class SelfAccumulating(nn.Module):
    """A backend leaf under the contract of ``enable_wgrad_fusion``: its weight, also named by
    a parameter view (as mtl-te names TE's LayerNormMLP weights ``linear_fc1.weight``)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16, bias=False)  # the weight's real holder, a submodule
        self.view = nn.Module()
        self.view.weight = self.inner.weight
        self.view.mtl_parameter_view = True
        self.switched_on = False

    def main_grad_accumulation_params(self):
        return [self.inner.weight]

    def enable_main_grad_accumulation(self):
        self.switched_on = True

    def forward(self, x):
        if self.switched_on:
            return _AddIntoMainGrad.apply(x, self.inner.weight)
        return self.inner(x)


def test_a_backend_module_that_accumulates_into_main_grad_itself():
    def run(fuse: bool):
        torch.manual_seed(0)
        module = nn.Sequential(SelfAccumulating(), ColumnParallelLinear(16, 8, bias=False)).to(torch.bfloat16)
        if fuse:
            assert enable_wgrad_fusion(module) == 2  # the backend module's weight and the linear's
        model = DataParallel(module, Topology.single(), grad_dtype=torch.float32, bucket_size_mb=1e-4,
                             overlap_grad_reduce=True)
        model.zero_grad()
        first, last = micro_batches()
        with model.no_sync():
            module(first).float().square().sum().backward()
        module(last).float().square().sum().backward()
        assert all(b.launched for b in model.buckets)  # the placeholder gradient fired the hook
        model.finish_grad_sync()
        return module

    fused = run(True)
    assert fused[0].switched_on and fused[0].inner.weight.wgrad_fused
    plain = run(False)
    # the same sum, the fused one in fp32 rather than per-micro-batch bf16 products
    torch.testing.assert_close(fused[0].inner.weight.main_grad, plain[0].inner.weight.main_grad, rtol=2e-2, atol=2e-2)
    assert not torch.equal(fused[0].inner.weight.main_grad, plain[0].inner.weight.main_grad)


def test_a_backend_module_whose_weight_is_also_held_elsewhere_stays_off():
    module = nn.Sequential(SelfAccumulating(), nn.Linear(16, 16))
    module[1].weight = module[0].inner.weight  # tied to a holder outside the contract
    assert enable_wgrad_fusion(module) == 0
    assert not module[0].switched_on and not getattr(module[0].inner.weight, "wgrad_fused", False)


def test_a_parameter_held_only_by_a_view_is_not_fused():
    """A view names parameters; it does not accumulate them. Held by nothing else, a parameter
    keeps the hook's path (else its gradient would be dropped)."""
    module = nn.Module()
    module.view = nn.Module()
    module.view.weight = nn.Parameter(torch.zeros(4, 4))
    module.view.mtl_parameter_view = True
    assert enable_wgrad_fusion(module) == 0
    assert not getattr(module.view.weight, "wgrad_fused", False)


def test_modules_sharing_a_weight_switch_on_together_or_not_at_all():
    """``a`` claims W; ``b`` claims W and X, and X is also held outside the contract: ``b``
    cannot switch on, so W stays on the hook's path, and so ``a`` must stay off too (else its
    backward would add into main_grad and the hook would add its placeholder as well)."""

    class Claimer(nn.Module):
        def __init__(self, *weights):
            super().__init__()
            self.ws = nn.ParameterList(weights)
            self.on = False

        def main_grad_accumulation_params(self):
            return list(self.ws)

        def enable_main_grad_accumulation(self):
            self.on = True

    w, x = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2, 2))
    module = nn.Module()
    module.a, module.b = Claimer(w), Claimer(w, x)
    module.other = nn.Linear(2, 2)
    module.other.weight = x  # outside the contract
    assert enable_wgrad_fusion(module) == 0
    assert not module.a.on and not module.b.on
    assert not getattr(w, "wgrad_fused", False) and not getattr(x, "wgrad_fused", False)
    module.other.weight = nn.Parameter(torch.zeros(2, 2))  # X no longer shared: both switch on
    assert enable_wgrad_fusion(module) == 2 and module.a.on and module.b.on
