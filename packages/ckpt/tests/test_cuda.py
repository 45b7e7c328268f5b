"""GPU tensors: save copies device->host, load copies host->device (skipped without CUDA)."""

import pytest
import torch

from mtl.ckpt import AsyncSaver, ShardedTensor, load, save

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_shards_round_trip_sync_and_async(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64, 32, device="cuda", generator=g).to(torch.bfloat16)
    m = torch.randn(32, device="cuda", generator=g)
    state = {"w": ShardedTensor("w", w, (64, 32), (0, 0)), "m": ShardedTensor("m", m, (32,), (0,))}
    save(state, str(tmp_path / "sync"), 1)
    expected_w, expected_m = w.clone(), m.clone()
    saver = AsyncSaver()
    saver.save(state, str(tmp_path / "async"), 1)
    w.add_(1)  # a training step on the GPU while the writer thread runs
    m.mul_(-2)
    saver.wait()
    for sub in ("sync", "async"):
        # load at "tp=2, rank 1" into fp32 GPU buffers: a resharding load with a cast
        tw = ShardedTensor("w", torch.zeros(32, 32, device="cuda"), (64, 32), (32, 0))
        tm = ShardedTensor("m", torch.zeros(32, device="cuda", dtype=torch.float64), (32,), (0,))
        load({"w": tw, "m": tm}, str(tmp_path / sub))
        assert tw.data.is_cuda and torch.equal(tw.data, expected_w[32:].float())
        assert torch.equal(tm.data, expected_m.double())
