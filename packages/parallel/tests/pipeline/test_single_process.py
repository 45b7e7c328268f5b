"""Pipeline pieces that need no process group: the pp = 1 schedule, the layer split and the
errors raised for bad input."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import pp_cases  # noqa: E402
import pp_toy  # noqa: E402

from mtl.core.errors import ConfigError, ParallelError  # noqa: E402
from mtl.parallel.pipeline import allreduce_shared_embedding_grads, forward_backward, stage_layer_range  # noqa: E402
from mtl.parallel.pipeline.p2p import check_tensor_shape  # noqa: E402
from mtl.parallel.topology import Topology  # noqa: E402

TOL = 1e-6


def _whole_model_chunk(tied: bool, num_layers: int = 3) -> pp_toy.ToyChunk:
    return pp_toy.ToyChunk(pp_toy.ToyModel(num_layers, tied), 0, num_layers, True, True)


@pytest.mark.parametrize("tied", [False, True])
def test_no_pipelining_accumulates_like_reference(tied):
    num_micro_batches = 3
    chunk = _whole_model_chunk(tied)
    recorder = pp_cases.SyncRecorder()
    events = {name: [] for name in chunk.params}
    for name, param in chunk.params.items():
        param.register_hook(lambda grad, name=name: events[name].append(recorder.syncing))
    metrics = forward_backward(
        pp_toy.forward_step,
        iter(pp_toy.make_micro_batches(num_micro_batches)),
        [chunk],
        num_micro_batches,
        pp_toy.TENSOR_SHAPE,
        torch.float32,
        Topology.single(),
        no_sync_func=recorder.no_sync,
    )
    ref_losses, ref_grads = pp_toy.reference(3, tied, num_micro_batches)
    assert [m["loss"].item() for m in metrics] == pytest.approx(ref_losses, abs=TOL)
    for name, param in chunk.params.items():
        torch.testing.assert_close(param.grad, ref_grads[name], atol=TOL, rtol=0)
        assert events[name] == [False, False, True]  # reduced in the last backward only
    allreduce_shared_embedding_grads([chunk], Topology.single())  # pp = 1: leaves grads alone
    torch.testing.assert_close(chunk.params["embedding"].grad, ref_grads["embedding"], atol=TOL, rtol=0)


def test_no_pipelining_forward_only_leaves_no_grads():
    chunk = _whole_model_chunk(tied=False)
    metrics = forward_backward(
        pp_toy.forward_step,
        iter(pp_toy.make_micro_batches(2)),
        [chunk],
        2,
        pp_toy.TENSOR_SHAPE,
        torch.float32,
        Topology.single(),
        forward_only=True,
    )
    assert [m["loss"].item() for m in metrics] == pytest.approx(pp_toy.reference(3, False, 2)[0], abs=TOL)
    assert all(p.grad is None for p in chunk.parameters())


def test_stage_layer_range_interleaved():
    # pp = 2, vpp = 2, 8 layers: virtual stage v = chunk * pp + rank holds layers 2v, 2v+1.
    expected = {(0, 0): (0, 2), (1, 0): (2, 4), (0, 1): (4, 6), (1, 1): (6, 8)}
    for (rank, chunk), layers in expected.items():
        assert stage_layer_range(8, Topology(pp=2, vpp=2, rank=rank), chunk) == layers


def test_stage_layer_range_explicit_first_and_last():
    # 10 layers over pp = 4 with 1 on the first and 3 on the last stage: 1, 3, 3, 3.
    ranges = [stage_layer_range(10, Topology(pp=4, rank=r), 0, 1, 3) for r in range(4)]
    assert ranges == [(0, 1), (1, 4), (4, 7), (7, 10)]


def test_stage_layer_range_explicit_virtual_stages():
    # 24 layers at pp = 2, vpp = 2 as [7, 6, 6, 5]: rank 0 holds 0-6 and 13-18, rank 1 7-12 and 19-23.
    expected = {(0, 0): (0, 7), (1, 0): (7, 13), (0, 1): (13, 19), (1, 1): (19, 24)}
    for (rank, chunk), layers in expected.items():
        topology = Topology(pp=2, vpp=2, rank=rank)
        assert stage_layer_range(24, topology, chunk, virtual_stage_layers=[7, 6, 6, 5]) == layers


def test_stage_layer_range_rejects_bad_input():
    with pytest.raises(ParallelError, match="vpp_chunk = 2"):
        stage_layer_range(8, Topology(pp=2, vpp=2), 2)
    with pytest.raises(ConfigError, match="not divisible by pp\\*vpp"):
        stage_layer_range(6, Topology(pp=2, vpp=2), 0)


def test_bad_schedule_input_is_refused():
    chunk = _whole_model_chunk(tied=False)
    common = (pp_toy.forward_step, iter([]))
    with pytest.raises(ParallelError, match="vpp = 1"):
        forward_backward(*common, [chunk, chunk], 2, pp_toy.TENSOR_SHAPE, torch.float32, Topology.single())
    with pytest.raises(ParallelError, match="multiple of pp"):
        forward_backward(*common, [chunk, chunk], 3, pp_toy.TENSOR_SHAPE, torch.float32, Topology(pp=2, vpp=2))
    with pytest.raises(ParallelError, match="at least 1"):
        forward_backward(*common, [chunk], 0, pp_toy.TENSOR_SHAPE, torch.float32, Topology.single())
    with pytest.raises(ParallelError, match="one iterator per chunk"):
        forward_backward(pp_toy.forward_step, [iter([])], [chunk, chunk], 2, (4, 2, 8), torch.float32, Topology(pp=2, vpp=2))
    with pytest.raises(ParallelError, match=r"shape \(4, 2, 7\).*tensor_shape=\(4, 2, 8\)"):
        check_tensor_shape(torch.zeros(4, 2, 7), (4, 2, 8), "activation sent forward")
