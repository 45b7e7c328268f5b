"""AsyncSaver: snapshot on the caller's thread, writes in a thread, commit in wait()."""

import json
import os
import threading

import torch

from mtl.ckpt import AsyncSaver, ShardedTensor, latest_iteration, load, save
from mtl.ckpt.save import write_shards
from mtl.ckpt import async_save


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": ShardedTensor("w", torch.randn(5, 4, generator=g), (5, 4), (0, 0)),
        "h": ShardedTensor("h", torch.randn(3, generator=g).to(torch.bfloat16), (3,), (0,)),
        "step": seed,
    }


def test_async_commits_only_in_wait_and_snapshots_before_returning(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "async")
    release = threading.Event()
    real_write = write_shards

    def held_write(plan):
        release.wait(timeout=30)  # the writer is held until the test lets it go
        return real_write(plan)

    monkeypatch.setattr(async_save, "write_shards", held_write)
    state = make_state(1)
    expected = {k: v.data.clone() for k, v in state.items() if isinstance(v, ShardedTensor)}
    saver = AsyncSaver()
    saver.save(state, ckpt, 100, {"m": 1})
    assert saver.in_flight == 100
    for shard in (state["w"], state["h"]):
        shard.data.mul_(-3).add_(7)  # training updates parameters in place meanwhile
    assert not os.path.exists(os.path.join(ckpt, "latest"))
    assert os.path.isdir(os.path.join(ckpt, "iter_0000100.partial"))
    release.set()
    assert saver.wait() == os.path.join(os.path.abspath(ckpt), "iter_0000100")
    assert saver.in_flight is None and latest_iteration(ckpt) == 100

    template = make_state(0)
    loaded, meta = load(template, ckpt)
    assert meta == {"m": 1} and loaded["step"] == 1
    for key, value in expected.items():
        assert torch.equal(template[key].data, value)


def test_async_equals_sync_and_next_save_waits(tmp_path):
    sync_dir, async_dir = str(tmp_path / "s"), str(tmp_path / "a")
    with AsyncSaver() as saver:
        for it in (1, 2):
            state = make_state(it)
            save(state, sync_dir, it, {"it": it})
            saver.save(state, async_dir, it, {"it": it})  # the second call first commits the first
            if it == 1:
                assert saver.in_flight == 1
        assert latest_iteration(async_dir) == 1  # iteration 2 is still in flight
    assert latest_iteration(async_dir) == 2
    for it in (1, 2):
        name = f"iter_{it:07d}"
        sync_meta = json.load(open(os.path.join(sync_dir, name, "metadata.json")))
        async_meta = json.load(open(os.path.join(async_dir, name, "metadata.json")))
        assert sync_meta["tensors"] == async_meta["tensors"] and sync_meta["common"] == async_meta["common"]
        a, s = make_state(0), make_state(0)
        load(a, async_dir, it)
        load(s, sync_dir, it)
        assert torch.equal(a["w"].data, s["w"].data) and torch.equal(a["h"].data, make_state(it)["h"].data)


def test_async_write_failure_is_raised_by_wait(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    save(make_state(1), ckpt, 1)
    monkeypatch.setattr(async_save, "write_shards", lambda plan: (_ for _ in ()).throw(OSError("no space left")))
    saver = AsyncSaver()
    saver.save(make_state(2), ckpt, 2)
    try:
        saver.wait()
        raised = None
    except Exception as exc:  # noqa: BLE001 - checked below
        raised = exc
    assert raised is not None and "OSError: no space left" in str(raised)
    assert latest_iteration(ckpt) == 1 and saver.in_flight is None
