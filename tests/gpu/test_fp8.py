"""mtl-quant's FP8 linear on a GPU: its GEMMs at the reference model's shapes against fp32, the
layer compiled against eager, and a short training run of a 2-layer slice of the reference
model with each recipe, compiled and eager, against bf16.

    python -m pytest -m gpu tests/gpu/test_fp8.py

The bounds separate a working FP8 path from a broken one with room on both sides: on an H100
the GEMM errors were 3.7e-2 to 5.9e-2 (e4m3/e5m2 rounding), compiled against eager 1e-6 or less,
and every FP8 run ended within 0.05% of bf16's loss after 8 steps, where a compiled FP8 run
whose weights stopped learning (inductor lowering ``torch._scaled_mm`` itself) ended 4.4% above.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GEMM_REL_ERROR = 0.1
COMPILED_REL_ERROR = 1e-4
LOSS_REL_DIFF = 0.01
SHAPES = [(2048, 6144), (2048, 11264), (5632, 2048)]  # (in, out) of QKV, fc1, fc2
TOKENS = 8192
ITERS = 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fp8_layer(inp: int, out: int, recipe: str):
    from mtl.core.registrations import Fp8Settings
    from mtl.quant.factories import column_linear

    torch.manual_seed(0)
    return column_linear(inp, out, bias=False, init_std=0.02, topology=None,
                         fp8=Fp8Settings(recipe)).cuda().to(torch.bfloat16)


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
@pytest.mark.parametrize("inp,out", SHAPES)
def test_fp8_gemms_close_to_fp32(recipe, inp, out):
    layer = fp8_layer(inp, out, recipe)
    x = torch.randn(TOKENS, 1, inp, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, 1, out, device="cuda", dtype=torch.bfloat16) * 1e-4  # loss gradients are small
    y = layer(x)
    y.backward(dy)
    w, x32 = layer.weight.detach().float(), x.detach().float()
    assert layer.weight.grad is not None, "the FP8 layer wrote no weight gradient"
    errors = {"y": rel(y, x32 @ w.t()), "dx": rel(x.grad, dy.float() @ w),
              "dW": rel(layer.weight.grad, dy.float().reshape(-1, out).t() @ x32.reshape(-1, inp))}
    assert max(errors.values()) < GEMM_REL_ERROR, f"{recipe} [{TOKENS}, {inp}] x [{out}, {inp}]: {errors}"


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_compiled_fp8_layer_matches_eager(recipe):
    from mtl.quant.weight_cache import invalidate_weight_caches

    layer = fp8_layer(2048, 11264, recipe)
    x = torch.randn(TOKENS, 1, 2048, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, 1, 11264, device="cuda", dtype=torch.bfloat16) * 1e-4
    results = []
    torch._dynamo.reset()
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        invalidate_weight_caches()  # each run quantizes W itself (compiled: inside the graph)
        layer.weight.grad = None
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad, layer.weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    assert dw1 is not None, "the compiled FP8 layer wrote no weight gradient"
    errors = {"y": rel(y1, y0), "dx": rel(dx1, dx0), "dW": rel(dw1, dw0)}
    assert max(errors.values()) < COMPILED_REL_ERROR, f"compiled vs eager {recipe}: {errors}"


SLICE = [f"train.iters={ITERS}", "train.device='cuda'", "train.precision='bf16'", "model.num_layers=2",
         "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048",
         "model.normalization='rmsnorm'", "model.activation='swiglu'", "model.position_embedding='rope'",
         "model.tie_embeddings=false", "train.micro_batch_size=4", "train.global_batch_size=8", "train.lr=3e-4"]


@pytest.fixture(scope="module")
def bf16_losses() -> dict[int, float]:
    from mtl.train.testing import run_tiny

    return run_tiny([*SLICE, "model.backend='local'", "train.compile=true"], with_grads=False)["losses"]


@pytest.mark.parametrize("name,overrides", [
    ("current compiled", ["train.fp8='current'", "train.compile=true"]),
    ("current eager", ["train.fp8='current'", "train.compile=false"]),
    ("delayed compiled", ["train.fp8='delayed'", "train.compile=true"]),
])
def test_fp8_training_follows_bf16(name, overrides, bf16_losses):
    from mtl.train.testing import run_tiny

    losses = run_tiny([*SLICE, "model.backend='fp8'", *overrides], with_grads=False)["losses"]
    last = max(bf16_losses)
    diff = abs(losses[last] - bf16_losses[last]) / bf16_losses[last]
    assert diff < LOSS_REL_DIFF, f"fp8 {name}: {list(losses.values())} vs bf16 {list(bf16_losses.values())}"
