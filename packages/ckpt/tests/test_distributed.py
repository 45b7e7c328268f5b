"""Multi-process save and resharding load over gloo: 2 ranks save, 1 and 4 ranks load."""

import json
import os

import pytest
import torch

from mtl.ckpt import AsyncSaver, ShardedTensor, latest_iteration, load, save
from mtl.ckpt import storage
from mtl.core.errors import CheckpointError
from mtl.parallel.testing import run_distributed


def global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(8, 6, generator=g),  # rows split evenly over 2 ranks
        "bf": torch.randn(4, 8, generator=g).to(torch.bfloat16),  # columns split
        "uneven": torch.randint(0, 1000, (5, 3), generator=g),  # rows 0-1 on rank 0, 2-4 on rank 1
        "norm": torch.randn(6, generator=g),  # replicated: rank 0 writes, rank 1 holds a copy
    }


def two_rank_state(rank: int) -> dict:
    t = global_tensors()
    rows = slice(0, 2) if rank == 0 else slice(2, 5)
    return {
        "model": {
            "w": ShardedTensor("w", t["w"][4 * rank : 4 * rank + 4].clone(), (8, 6), (4 * rank, 0)),
            "bf": ShardedTensor("bf", t["bf"][:, 4 * rank : 4 * rank + 4].clone(), (4, 8), (0, 4 * rank)),
            "uneven": ShardedTensor("uneven", t["uneven"][rows].clone(), (5, 3), (rows.start, 0)),
            "norm": ShardedTensor("norm", t["norm"].clone(), (6,), (0,), replica_id=rank),
        },
        "step": 10,
    }


def _save_two_ranks(sync_dir: str, async_dir: str) -> list:
    rank = torch.distributed.get_rank()
    state = two_rank_state(rank)
    save(state, sync_dir, 10, {"run": "sync"})
    saver = AsyncSaver()
    saver.save(state, async_dir, 10, {"run": "sync"})
    for shard in state["model"].values():  # training goes on while the writer thread runs
        shard.data.add_(1)
    saver.wait()
    # a save that fails on rank 1 only: every rank must raise, and nothing is committed
    original = storage.start_write
    if rank == 1:
        storage.start_write = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (injected)"))
    try:
        save(state, sync_dir, 20, {"run": "broken"})
        outcome = "saved"
    except CheckpointError as exc:
        outcome = str(exc)
    finally:
        storage.start_write = original
    try:  # ranks disagreeing on the iteration are caught before anything is written
        save(state, sync_dir, 30 + rank, {})
        mismatch = "saved"
    except CheckpointError as exc:
        mismatch = str(exc)
    return [outcome, latest_iteration(sync_dir), mismatch]


def _load_four_ranks(ckpt_dir: str) -> dict:
    # a 2x2 grid over [8, 6]; a column split of [4, 8] in 4; rows of [5, 3] in 4 uneven pieces
    rank = torch.distributed.get_rank()
    r0, c0 = 4 * (rank // 2), 3 * (rank % 2)
    row_starts = [0, 1, 3, 4, 5]
    template = {
        "model": {
            "w": ShardedTensor("w", torch.zeros(4, 3, dtype=torch.float64), (8, 6), (r0, c0)),
            "bf": ShardedTensor("bf", torch.zeros(4, 2, dtype=torch.bfloat16), (4, 8), (0, 2 * rank)),
            "uneven": ShardedTensor(
                "uneven", torch.zeros(row_starts[rank + 1] - row_starts[rank], 3, dtype=torch.int64), (5, 3), (row_starts[rank], 0)
            ),
            "norm": ShardedTensor("norm", torch.zeros(6), (6,), (0,), replica_id=rank),
        },
        "step": 0,
    }
    state, meta = load(template, ckpt_dir)
    return {"step": state["step"], "meta": meta, **{k: v.data for k, v in template["model"].items()}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    sync_dir, async_dir = str(root / "sync"), str(root / "async")
    results = run_distributed(_save_two_ranks, 2, (sync_dir, async_dir))
    return sync_dir, async_dir, results


def test_two_rank_save_loads_at_one_rank(saved):
    sync_dir, _, _ = saved
    t = global_tensors()
    template = {k: ShardedTensor(k, torch.zeros_like(v), tuple(v.shape), (0,) * v.dim()) for k, v in t.items()}
    state, meta = load({"model": template, "step": 0}, sync_dir)
    assert state["step"] == 10 and meta == {"run": "sync"}
    for k, v in t.items():
        assert torch.equal(template[k].data, v), k
    manifest = json.load(open(os.path.join(sync_dir, "iter_0000010", "metadata.json")))
    assert len(manifest["tensors"]["norm"]["shards"]) == 1  # the replica was written once
    assert manifest["tensors"]["uneven"]["chunk_shape"] == [1, 3]  # gcd of row boundaries 0, 2, 5
    assert manifest["tensors"]["w"]["chunk_shape"] == [4, 6]


def test_two_rank_save_loads_at_four_ranks(saved):
    sync_dir, _, _ = saved
    t = global_tensors()
    results = run_distributed(_load_four_ranks, 4, (sync_dir,))
    row_starts = [0, 1, 3, 4, 5]
    for rank, got in enumerate(results):
        r0, c0 = 4 * (rank // 2), 3 * (rank % 2)
        assert got["step"] == 10 and got["meta"] == {"run": "sync"}
        assert torch.equal(got["w"], t["w"][r0 : r0 + 4, c0 : c0 + 3].double())
        assert torch.equal(got["bf"].view(torch.int16), t["bf"][:, 2 * rank : 2 * rank + 2].view(torch.int16))
        assert torch.equal(got["uneven"], t["uneven"][row_starts[rank] : row_starts[rank + 1]])
        assert torch.equal(got["norm"], t["norm"])


def test_async_save_equals_sync_save(saved):
    sync_dir, async_dir, _ = saved
    sync_manifest = json.load(open(os.path.join(sync_dir, "iter_0000010", "metadata.json")))
    async_manifest = json.load(open(os.path.join(async_dir, "iter_0000010", "metadata.json")))
    # same bytes on disk: every shard's checksum matches (the in-place update after
    # AsyncSaver.save returned did not leak into the checkpoint)
    assert async_manifest["tensors"] == sync_manifest["tensors"]
    t = global_tensors()
    template = {k: ShardedTensor(k, torch.zeros_like(v), tuple(v.shape), (0,) * v.dim()) for k, v in t.items()}
    load({"model": template}, async_dir, strict=False)
    for k, v in t.items():
        assert torch.equal(template[k].data, v), k


def test_failure_on_one_rank_fails_every_rank_and_keeps_previous(saved):
    sync_dir, _, results = saved
    for outcome, latest, mismatch in results:
        assert "rank 1: OSError: disk full (injected)" in outcome
        assert latest == 10
        assert "rank 0 saves iteration 30" in mismatch and "rank 1 saves iteration 31" in mismatch
    assert os.path.isdir(os.path.join(sync_dir, "iter_0000020.partial"))
    assert not os.path.exists(os.path.join(sync_dir, "iter_0000020"))
    assert not [name for name in os.listdir(sync_dir) if name.startswith(("iter_0000030", "iter_0000031"))]
