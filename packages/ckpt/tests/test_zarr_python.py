"""zarr-python (no tensorstore) reads what tensorstore wrote; inspect_checkpoint's numbers."""

import math
import os

import numpy as np
import pytest
import torch

from mtl.ckpt import ShardedTensor, save
from mtl.ckpt.inspect import inspect_checkpoint, read_array

zarr = pytest.importorskip("zarr")


@pytest.fixture()
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "fp32": torch.randn(6, 4, generator=g),
        "bf16": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-3, 5),
    }
    state = {k: ShardedTensor(k, v, tuple(v.shape), (0,) * v.dim()) for k, v in tensors.items()}
    save(state, str(tmp_path), 3, {})
    return str(tmp_path), tensors


def test_zarr_python_reads_fp32_and_bf16_words(ckpt):
    ckpt_dir, tensors = ckpt
    arrays = os.path.join(ckpt_dir, "iter_0000003", "arrays")
    fp32 = zarr.open_array(store=os.path.join(arrays, "fp32"), mode="r")
    assert fp32.dtype == np.float32
    np.testing.assert_array_equal(fp32[...], tensors["fp32"].numpy())

    bf16 = zarr.open_array(store=os.path.join(arrays, "bf16"), mode="r")
    assert bf16.dtype == np.uint16 and bf16.attrs["mtl_logical_dtype"] == "bfloat16"
    decoded = torch.from_numpy(bf16[...].view(np.int16)).view(torch.bfloat16)
    assert torch.equal(decoded.view(torch.int16), tensors["bf16"].view(torch.int16))
    # the same words decoded by hand: bf16 is the top half of an fp32
    as_fp32 = (bf16[...].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(as_fp32, tensors["bf16"].float().numpy())

    group = zarr.open_group(os.path.join(ckpt_dir, "iter_0000003", "arrays"), mode="r")
    assert sorted(group.array_keys()) == ["bf16", "fp32", "ids"]


def test_read_array_and_inspect_rows(ckpt):
    ckpt_dir, tensors = ckpt
    assert torch.equal(read_array(ckpt_dir, "bf16").view(torch.int16), tensors["bf16"].view(torch.int16))
    rows = {row["key"]: row for row in inspect_checkpoint(ckpt_dir)}
    assert set(rows) == {"fp32", "bf16", "ids"}
    for key, t in tensors.items():
        ref = t.double()
        row = rows[key]
        assert row["shape"] == tuple(t.shape) and row["dtype"] == str(t.dtype).removeprefix("torch.")
        assert row["shards"] == 1
        assert row["min"] == ref.min().item() and row["max"] == ref.max().item()
        assert math.isclose(row["mean"], ref.mean().item(), rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(row["norm"], ref.norm().item(), rel_tol=1e-12)
    assert rows["ids"]["mean"] == 0.5 and rows["ids"]["min"] == -3.0
