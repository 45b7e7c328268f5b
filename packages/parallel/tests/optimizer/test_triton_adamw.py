"""The one-pass Triton AdamW (``triton_adamw``) against torch's fused AdamW + main -> model copy.

A ``ReplicatedOptimizer`` over bf16 weights with fp32 main grads (as ``DataParallel`` lays
them out) steps through ``clip_and_step`` 6 times: random gradients, an LR changed every
step, one clipped step (grad_scale != 1) and one skipped step (found_inf = 1: nothing may
change, step counts included). A second copy of the weights steps with torch's
``AdamW(fused=True)`` given the same grad_scale/found_inf, then copies main -> bf16.

On CUDA the kernel follows torch's CUDA formula, but torch 2.11's kernel rounds some
intermediate terms elsewhere (on an H100: weights up to 64 ulps apart where they are small,
moments up to 1.4e-8 apart where a moment is a cancellation of larger terms; after four steps
weights 2 ulps apart). So the weights must agree within 1e-5 of the step's size (lr) plus 4
ulps, the moments within a millionth of their largest value.
The bf16 weights must equal the main weights rounded to nearest even, exactly.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors:

    MTL_TEST_TRITON_INTERPRET=1 TRITON_INTERPRET=1 PYTHONPATH=<triton wheel> pytest <this file>

torch's CPU fused AdamW uses other arithmetic (fp32 throughout, a lerp for the first moment),
so there the kernel is checked bitwise against an emulation of the CUDA arithmetic in torch
ops, and only closely against torch's CPU AdamW.
"""

import os

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from mtl.parallel.optimizer import ReplicatedOptimizer, triton_adamw
from mtl.parallel.optimizer.adamw_shell import StateEntry
from mtl.parallel.optimizer.grad_norm import CLIP_EPS
from mtl.parallel.topology import Topology

INTERPRET = os.environ.get("MTL_TEST_TRITON_INTERPRET") == "1"
if INTERPRET:
    DEVICE = "cpu"
    pytestmark = pytest.mark.skipif(not triton_adamw.INTERPRETED,
                                    reason="MTL_TEST_TRITON_INTERPRET=1 needs TRITON_INTERPRET=1 and triton importable")
else:
    DEVICE = "cuda"
    pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and triton_adamw.AVAILABLE),
                                    reason="needs CUDA and triton (or MTL_TEST_TRITON_INTERPRET=1)")

SHAPES = {"a.weight": (3, 777), "b.weight": (17, 61), "c.bias": (1,), "d.norm": (1000,), "e.norm": (4097,)}
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LRS = [1e-2, 3e-3, 2e-2, 5e-3, 1e-3, 7e-3]
CLIPPED, SKIPPED = 2, 4  # step indices


class Model(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            mod, pname = name.split(".")
            if not hasattr(self, mod):
                self.add_module(mod, nn.Module())
            param = nn.Parameter(torch.randn(shape, generator=g).to(DEVICE, dtype))
            param.main_grad = torch.zeros(shape, device=DEVICE)  # as DataParallel gives lower-precision weights
            getattr(self, mod).register_parameter(pname, param)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp32 numbers at each element of ``x``."""
    x = x.detach().abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


class CudaMathAdamW:
    """torch's CUDA fused AdamW arithmetic written with torch ops (doubles where it uses
    double), for the interpreter run: torch's CPU kernel computes differently."""

    def __init__(self, params: list[torch.Tensor], decays: list[float]) -> None:
        self.p = [p.clone() for p in params]
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.decays, self.step_count = decays, 0.0

    def step(self, grads, lr, grad_scale=None, skip=False):
        if skip:
            return
        self.step_count += 1
        (b1, b2), eps = HP["betas"], HP["eps"]
        s = torch.tensor(self.step_count, dtype=torch.float64)
        bc1 = (1 - torch.pow(b1, s)).float()
        bc2_sqrt = torch.sqrt(1 - torch.pow(b2, s)).float()
        step_size = (torch.tensor(lr, dtype=torch.float64) / bc1.double()).float()
        for i, (g, wd) in enumerate(zip(grads, self.decays)):
            if grad_scale is not None:
                g = (g.double() / grad_scale.double()).float()
            p = self.p[i]
            if wd:
                p = (p.double() - (lr * wd) * p.double()).float()
            self.m[i] = (b1 * self.m[i].double() + (1 - b1) * g.double()).float()
            self.v[i] = (b2 * self.v[i].double() + (1 - b2) * g.double() * g.double()).float()
            # sqrt in double, then rounded: the IEEE fp32 sqrt (torch's CPU fp32 sqrt is not always).
            denom = ((self.v[i].double().sqrt().float() / bc2_sqrt).double() + eps).float()
            self.p[i] = p - step_size * self.m[i] / denom


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_and_step_matches_torch_fused_adamw(dtype):
    model = Model(dtype)
    opt = ReplicatedOptimizer([model], Topology.build(), **HP)
    assert opt.uses_triton_adamw
    names = [e.name for e in opt.entries]
    decay_of = {id(p): g["weight_decay"] for g in opt.inner.param_groups for p in g["params"]}
    decays = [decay_of[id(e.piece)] for e in opt.entries]
    assert sorted(set(decays)) == [0.0, HP["weight_decay"]]  # both groups are exercised

    # The reference: torch's fused AdamW over fp32 copies, in the same groups.
    ref = [nn.Parameter(e.piece.detach().clone()) for e in opt.entries]
    ref_opt = torch.optim.AdamW([{"params": [r for r, d in zip(ref, decays) if d], "weight_decay": HP["weight_decay"]},
                                 {"params": [r for r, d in zip(ref, decays) if not d], "weight_decay": 0.0}],
                                lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], fused=True)
    emulated = CudaMathAdamW([e.piece.detach() for e in opt.entries], decays)

    g = torch.Generator().manual_seed(1)
    for step, lr in enumerate(LRS):
        grads = [torch.randn(e.piece.shape, generator=g).to(DEVICE) for e in opt.entries]
        for e, grad in zip(opt.entries, grads):
            e.source.main_grad.copy_(grad)
        for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
            group["lr"] = ref_group["lr"] = lr
        norm_now = torch.linalg.vector_norm(torch.stack([x.norm() for x in grads])).item()
        max_norm = 0.5 * norm_now if step == CLIPPED else float("inf")
        skip = torch.ones((), device=DEVICE) if step == SKIPPED else None
        before = [(e.piece.detach().clone(), e.model_view.clone()) for e in opt.entries]

        norm, found_inf = opt.clip_and_step(max_norm, skip=skip)

        grad_scale = torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0) if step == CLIPPED else None
        for r, grad in zip(ref, grads):
            r.grad = grad.clone()  # torch writes the unscaled gradient back: fresh every step
        ref_opt.grad_scale, ref_opt.found_inf = grad_scale, found_inf
        ref_opt.step()
        emulated.step(grads, lr, grad_scale, skip=step == SKIPPED)

        for i, (e, r, name) in enumerate(zip(opt.entries, ref, names)):
            state, ref_state = opt.inner.state[e.piece], ref_opt.state[r]
            assert torch.equal(state["step"], ref_state["step"]), name
            assert state["step"].item() == (step if step >= SKIPPED else step + 1), name
            if step == SKIPPED:
                assert torch.equal(e.piece, before[i][0]) and torch.equal(e.model_view, before[i][1]), name
            if INTERPRET:  # bitwise against the emulated CUDA arithmetic, close to torch's CPU kernel
                assert torch.equal(e.piece.detach(), emulated.p[i]), (step, name)
                assert torch.equal(state["exp_avg"], emulated.m[i]), (step, name)
                assert torch.equal(state["exp_avg_sq"], emulated.v[i]), (step, name)
                torch.testing.assert_close(e.piece.detach(), r.detach(), rtol=1e-5, atol=1e-6)
            else:
                # The weights within 1e-5 of a step's size (lr) plus 4 roundings of the weight
                # (each step's rounding differences carry into the next); the moments within a
                # millionth of their largest value.
                update_error = ((e.piece - r).abs() - 4 * ulp(r)).clamp(min=0).max().item() / lr
                assert update_error <= 1e-5, (step, name, update_error)
                for moment in ("exp_avg", "exp_avg_sq"):  # (a moment near 0 is a cancellation of larger terms)
                    scale = ref_state[moment].abs().max().item()
                    torch.testing.assert_close(state[moment], ref_state[moment], rtol=1e-6, atol=1e-6 * scale)
            assert e.model_view.dtype == dtype
            assert torch.equal(e.model_view, e.piece.detach().to(dtype)), (step, name)  # torch's rounding


def test_torch_path_without_triton(monkeypatch):
    monkeypatch.setattr(triton_adamw, "AVAILABLE", False)  # as on an install without triton
    opt = ReplicatedOptimizer([Model(torch.bfloat16)], Topology.build(), **HP)
    assert not opt.uses_triton_adamw


@pytest.mark.parametrize("torch_path", [False, True], ids=["triton", "torch"])
def test_torch_step_hooks_run_around_the_update(monkeypatch, torch_path):
    """Process-wide and per-optimizer step hooks (mtl-quant's FP8 weight cache goes stale in
    one) see one step per update, before the weights change and after, on either path."""
    if torch_path:
        monkeypatch.setattr(triton_adamw, "AVAILABLE", False)  # as on an install without triton
    model = Model(torch.bfloat16)
    opt = ReplicatedOptimizer([model], Topology.build(), **HP)
    assert opt.uses_triton_adamw is not torch_path
    weight = opt.entries[0].piece  # the fp32 main weight: both paths update it inside the wrapper
    seen = []

    def pre(optimizer, args, kwargs):
        seen.append(("pre", optimizer is opt.inner, args == (opt.inner,), weight.detach().clone()))

    def post(optimizer, args, kwargs):
        seen.append(("post", optimizer is opt.inner, args == (opt.inner,), weight.detach().clone()))

    handles = [register_optimizer_step_pre_hook(pre),
               register_optimizer_step_post_hook(post),
               opt.inner.register_step_pre_hook(pre)]
    try:
        before = weight.detach().clone()
        for e in opt.entries:
            e.source.main_grad.normal_()
        opt.clip_and_step(float("inf"))
    finally:
        for handle in handles:
            handle.remove()
    assert [(when, mine, args) for when, mine, args, _ in seen] == [("pre", True, True)] * 2 + [("post", True, True)]
    assert torch.equal(seen[0][3], before) and torch.equal(seen[1][3], before)
    assert not torch.equal(seen[2][3], before)  # the post hook sees the updated weights


def test_bf16_rounding_of_ties_and_specials():
    """The kernel's own fp32 -> bf16 rounding equals torch's: ties to even, overflow, inf, NaN, -0."""
    values = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38, float("inf"), float("-inf"),
                           float("nan"), 0.0, -0.0], device=DEVICE)
    piece = nn.Parameter(values.clone())
    piece.grad = torch.zeros_like(values)
    model = torch.empty(values.shape, dtype=torch.bfloat16, device=DEVICE)
    opt = torch.optim.AdamW([piece], lr=0.0, weight_decay=0.0, fused=True)
    e = StateEntry(piece, piece, "x", 0, model_view=model)
    triton_adamw.adamw_step(opt, [e])  # lr 0: the weights stay, and are rounded into `model`
    expected = values.to(torch.bfloat16)
    nan = values.isnan()  # NaN bit patterns differ between torch's CPU and CUDA conversions
    assert torch.equal(model[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert model[nan].isnan().all()
