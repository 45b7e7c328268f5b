"""The backends on a GPU, Transformer Engine's where it is staged (scripts/gpu/te_stage.sh): the tiny model of
mtl.train.testing trained a few steps by each backend and recipe, same weights and batches;
the te backend in bf16 against the local backend in bf16, and every FP8 run against it.

    python -m pytest -m gpu tests/gpu/test_backends.py

On an H100 after 20 steps te bf16 was within 4.4e-5 of local bf16 and every FP8 run (TE
delayed, current, blockwise; mtl-quant current, row-wise) within 1e-4 of it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="needs Transformer Engine (scripts/gpu/te_stage.sh)")

ITERS = 20
TE_BF16_REL_DIFF = 1e-3
FP8_REL_DIFF = 0.01
COMMON = [f"train.iters={ITERS}", "train.device='cuda'", "train.precision='bf16'", "model.hidden_size=64",
          "model.num_attention_heads=4", "model.seq_length=64"]
FP8_RUNS = [
    pytest.param(["model.backend='te'", "train.fp8='delayed'"], id="te-delayed", marks=needs_te),
    pytest.param(["model.backend='te'", "train.fp8='current'"], id="te-current", marks=needs_te),
    pytest.param(["model.backend='te'", "train.fp8='blockwise'"], id="te-blockwise", marks=needs_te),
    pytest.param(["model.backend='fp8'", "train.fp8='current'"], id="fp8-current"),
    pytest.param(["model.backend='fp8'", "train.fp8='rowwise'", "train.fp8_format='e4m3'"], id="fp8-rowwise"),
]


def losses(overrides: list[str]) -> dict[int, float]:
    from mtl.train.testing import run_tiny

    return run_tiny([*COMMON, *overrides], with_grads=False)["losses"]


@pytest.fixture(scope="module")
def local_bf16() -> dict[int, float]:
    return losses(["model.backend='local'"])


@needs_te
def test_te_bf16_matches_local_bf16(local_bf16):
    te = losses(["model.backend='te'"])
    worst = max(abs(te[s] - local_bf16[s]) / local_bf16[s] for s in local_bf16)
    assert worst < TE_BF16_REL_DIFF, f"te bf16 {te} vs local bf16 {local_bf16}"


@pytest.mark.parametrize("overrides", FP8_RUNS)
def test_fp8_recipe_follows_local_bf16(overrides, local_bf16):
    run = losses(overrides)
    diff = abs(run[ITERS] - local_bf16[ITERS]) / local_bf16[ITERS]
    assert diff < FP8_REL_DIFF, f"{overrides}: {run} vs local bf16 {local_bf16}"
