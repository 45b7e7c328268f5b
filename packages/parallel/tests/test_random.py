"""The RNG tracker: streams are isolated, and dropout in TP regions varies over TP, not DP."""

import pytest
import torch
import torch.distributed as dist

from mtl.core.errors import ParallelError
from mtl.parallel.backend_local import CoreAttention
from mtl.parallel.random import MODEL_PARALLEL_STREAM, RNGStatesTracker, get_rng_tracker, seed_everything
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology


def test_fork_runs_on_its_own_stream_and_leaves_the_default_stream_alone():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 7)
    torch.manual_seed(0)
    expected_default = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.testing.assert_close(torch.rand(3), expected_default)  # default stream not advanced
    torch.manual_seed(7)
    torch.testing.assert_close(first, torch.rand(3))  # stream "a" is seed 7 ...
    torch.testing.assert_close(second, torch.rand(3))  # ... and advances between forks


def test_states_round_trip_replays_the_same_numbers():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 3)
    saved = tracker.get_states()
    with tracker.fork("a"):
        drawn = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("a"):
        torch.testing.assert_close(torch.rand(4), drawn)


def test_misuse_raises_parallel_errors():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 3)
    with pytest.raises(ParallelError, match="'a' already exists"):
        tracker.add("a", 4)
    with pytest.raises(ParallelError, match="reuse seed 3 of stream 'a'"):
        tracker.add("b", 3)
    with pytest.raises(ParallelError, match="'missing' is not initialised.*seed_everything"):
        with tracker.fork("missing"):
            pass


def test_seed_everything_single_process_uses_megatron_offsets():
    tracker = seed_everything(1234, device="cpu")
    drawn_default = torch.rand(2)
    with tracker.fork():
        drawn_tp = torch.rand(2)
    torch.manual_seed(1234)
    torch.testing.assert_close(drawn_default, torch.rand(2))
    torch.manual_seed(1234 + 2718)
    torch.testing.assert_close(drawn_tp, torch.rand(2))
    assert get_rng_tracker() is tracker and tracker.names() == [MODEL_PARALLEL_STREAM]


def dropout_streams_over_tp_and_dp():
    topo = Topology.build(tp=2)  # 4 ranks: tp=2, dp=2
    tracker = seed_everything(99, topo, device="cpu")
    x = torch.ones(64)
    outside = torch.nn.functional.dropout(x, p=0.5)
    with tracker.fork():
        inside = torch.nn.functional.dropout(x, p=0.5)
    torch.manual_seed(5)  # identical inputs everywhere; the dropout must come from the tracker
    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    attention = CoreAttention(num_heads=2, num_query_groups=2, head_dim=4, dropout=0.5, topology=topo)
    attended = attention(q, k, v)
    gathered = {}
    for name, t in (("outside", outside), ("inside", inside), ("attention", attended)):
        parts = [torch.empty_like(t) for _ in range(4)]
        dist.all_gather(parts, t.contiguous())
        gathered[name] = parts
    return topo.tp_rank, topo.dp_rank, gathered


def test_model_parallel_stream_differs_over_tp_and_matches_over_dp():
    results = run_distributed(dropout_streams_over_tp_and_dp, world_size=4)
    coords = [(tp, dp) for tp, dp, _ in results]
    assert coords == [(0, 0), (1, 0), (0, 1), (1, 1)]  # tp fastest
    g = results[0][2]
    for r in range(1, 4):  # replicated regions draw the same numbers on every rank
        torch.testing.assert_close(g["outside"][r], g["outside"][0])
    for name in ("inside", "attention"):
        torch.testing.assert_close(g[name][2], g[name][0])  # same tp rank, other dp replica
        torch.testing.assert_close(g[name][3], g[name][1])
        assert not torch.allclose(g[name][1], g[name][0])  # other tp rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tracker_on_gpu_swaps_the_cuda_generator():
    tracker = seed_everything(11, device="cuda")
    assert tracker.device == torch.device("cuda", torch.cuda.current_device())
    with tracker.fork():
        mask = torch.nn.functional.dropout(torch.ones(256, device="cuda"), p=0.5)
    default_draw = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(11 + 2718)
    torch.testing.assert_close(mask, torch.nn.functional.dropout(torch.ones(256, device="cuda"), p=0.5))
    torch.cuda.manual_seed(11)
    torch.testing.assert_close(default_draw, torch.rand(4, device="cuda"))
