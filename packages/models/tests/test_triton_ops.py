"""Defining mtl's triton_ops on an install without Triton (a CPU-only torch) logs nothing: torch's
lookup for the Triton kernels would warn on every import of the model code."""

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="Triton is installed here")
def test_importing_the_ops_without_triton_logs_nothing():
    run = subprocess.run([sys.executable, "-c", "import mtl.models.swiglu, mtl.models.gpt.rope_qkv, torch; "
                          "print(torch.ops.mtl.swiglu_backward, torch.ops.mtl.rope_qkv_backward)"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "mtl.swiglu_backward" in run.stdout and "mtl.rope_qkv_backward" in run.stdout
    assert run.stderr == ""


def test_torchs_logger_is_left_as_it_was():
    # the quiet applies while an operator is defined, and only then
    import logging

    import torch

    from mtl.models.triton_ops import triton_op

    logger = logging.getLogger("torch._library.triton")
    level = logger.level

    def restored(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    triton_op("mtl_test::restored", mutates_args=())(restored)
    assert logger.level == level
    assert torch.equal(torch.ops.mtl_test.restored(torch.ones(2)), torch.ones(2))
