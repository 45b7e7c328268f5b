"""The backend suite (``mtl.train.backend_suite``) for the ``fp8`` backend, one case per
recipe. The acceptance bound is tp=2 within 1e-3 of one process; per-tensor scaling gives
one process's losses exactly, because every amax TP or CP splits is reduced before it is used
(cp2 without the CP reduction: weight gradients 15% apart).
Row-wise scaling re-quantizes each backward operand from high precision along another axis:
an ulp of fp32 accumulation-order difference between a tp=2 GEMM and one process's can move
an element across an FP8 rounding boundary, so its gradients agree to a few percent (losses
to 1e-5)."""

import pytest

from mtl.train.backend_suite import *  # noqa: F403 (the suite's tests, collected here)
from mtl.train.backend_suite import BackendCase

FP8 = ["model.backend='fp8'"]
CASES = [
    # a decoding step's per-tensor amax covers one token, the full forward's all of them:
    # the cached logits match the full ones to FP8 precision, not fp32's
    BackendCase("fp8-current", [*FP8, "train.fp8='current'"], loss_rtol=1e-3, grad_rel=1e-3, logits_atol=5e-2,
                layouts=("tp2", "tp2_sp", "pp2", "cp2", "cp2_allgather")),
    BackendCase("fp8-delayed", [*FP8, "train.fp8='delayed'"], loss_rtol=1e-3, grad_rel=1e-3, logits_atol=5e-2,
                layouts=("tp2_sp", "cp2")),
    # Megatron's precision layout: bf16 weights, fp32 main weights and gradients; the amax
    # histories stay fp32. bf16 GEMM partial sums at tp=2 round differently from one process's
    # (the local backend in bf16 already differs by ~6e-3 in gradient norm) and FP8 re-rounds
    # that (norm-weight gradients ~10%): losses only.
    BackendCase("fp8-delayed-bf16-weights", [*FP8, "train.fp8='delayed'", "train.precision='bf16'",
                                             "train.params_dtype='bf16'"],
                loss_rtol=1e-3, grad_rel=None, logits_atol=1e-1, layouts=("tp2",)),
    BackendCase("fp8-rowwise", [*FP8, "train.fp8='rowwise'", "train.fp8_format='e4m3'"], loss_rtol=1e-3,
                grad_rel=1e-1, logits_atol=1e-4, layouts=("tp2", "cp2")),
]


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def backend_case(request):
    return request.param
