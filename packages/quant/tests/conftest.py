"""Row-wise scaling runs on CPU only from torch 2.13 on (``scaled_matmul.CPU_ROWWISE``): on an
older torch (the GPU machines' 2.11 runs this suite on its CPU) every test with "rowwise" in its
name or parameters is skipped, named, except those marked ``any_torch`` (the error's own test)."""

import pytest

import mtl.quant.scaled_matmul as scaled_matmul


def pytest_configure(config):
    config.addinivalue_line("markers", "any_torch: runs on every torch, row-wise FP8 on CPU or not")


def pytest_collection_modifyitems(config, items):
    if scaled_matmul.CPU_ROWWISE:
        return
    skip = pytest.mark.skip(reason="row-wise FP8 on CPU needs torch >= 2.13 (torch._scaled_mm)")
    for item in items:
        if "rowwise" in item.name and item.get_closest_marker("any_torch") is None:
            item.add_marker(skip)
