"""Row-wise scaling runs on CPU only from torch 2.13 on (``scaled_matmul.CPU_ROWWISE``): on an
older torch (the GPU machines' 2.11 runs this suite on its CPU) those cases are skipped, named."""

import pytest

from mtl.quant.scaled_matmul import CPU_ROWWISE


def pytest_collection_modifyitems(config, items):
    if CPU_ROWWISE:
        return
    skip = pytest.mark.skip(reason="row-wise FP8 on CPU needs torch >= 2.13 (torch._scaled_mm)")
    for item in items:
        if "rowwise" in item.name and "cuda" not in item.name:
            item.add_marker(skip)
