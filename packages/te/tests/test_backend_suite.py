"""The backend suite (``mtl.train.backend_suite``) for the ``te`` backend, in bf16 and FP8.

Runs only where Transformer Engine imports and sees a GPU (skipped, named, elsewhere). The
layout equivalence needs a GPU per rank: on a one-GPU machine the cases keep no layouts and
the suite checks the checkpoint round trip and KV-cache generation."""

import pytest
import torch

from mtl.te.availability import te_import_error
from mtl.train.backend_suite import *  # noqa: F403 (the suite's tests, collected here)
from mtl.train.backend_suite import BackendCase

pytestmark = pytest.mark.skipif(te_import_error() is not None, reason=f"Transformer Engine not usable: {te_import_error()}")

LAYOUTS = ("tp2", "tp2_sp", "pp2") if torch.cuda.device_count() >= 2 else ()
TE = ["model.backend='te'", "train.precision='bf16'"]
CASES = [
    BackendCase("te-bf16", TE, loss_rtol=1e-2, grad_rel=5e-2, logits_atol=5e-2, layouts=LAYOUTS, device="cuda"),
    BackendCase("te-fp8-current", [*TE, "train.fp8='current'"], loss_rtol=1e-2, grad_rel=1e-1, logits_atol=2e-1,
                layouts=LAYOUTS, device="cuda"),
    # train.compile defaults to on on a GPU, but off for te FP8 (Backend.fp8_compiles): the
    # case above runs eagerly; these pin it on, the FP8 TE modules then running eagerly inside
    # a compiled layer (modules.py, _fp8_call)
    BackendCase("te-fp8-current-compiled", [*TE, "train.fp8='current'", "train.compile=true"], loss_rtol=1e-2,
                grad_rel=1e-1, logits_atol=2e-1, layouts=LAYOUTS, device="cuda"),
    BackendCase("te-fp8-delayed-compiled", [*TE, "train.fp8='delayed'", "train.compile=true"], loss_rtol=1e-2,
                grad_rel=1e-1, logits_atol=2e-1, layouts=LAYOUTS, device="cuda"),
]


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def backend_case(request):
    return request.param
