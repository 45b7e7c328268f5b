"""A module's extra state (``get_extra_state``, how Transformer Engine keeps FP8 amax
histories) is saved and restored by a resume, through the real trainer and zarr files, so the
resumed run continues the history of the uninterrupted one; a checkpoint without it leaves
the modules fresh and says so."""

import dataclasses
import logging

import pytest
import torch

from mtl.core import plugins
from mtl.core.config_io import load_config
from mtl.core.hookspecs import hookimpl
from mtl.parallel.backend_local.norms import RMSNorm
from mtl.parallel.backend_plugin import LOCAL_BACKEND
from mtl.parallel.testing import run_distributed
from mtl.train.layout_change import extra_state_layout_change
from mtl.train.extra_state import modules_with_extra_state
from mtl.train.loop import train
from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")] + ["model.normalization='rmsnorm'", "train.lr_decay_iters=4"]


class HistoryNorm(RMSNorm):
    """RMSNorm that records the amax of its inputs in a history outside its parameters and
    buffers, as an FP8 module does: only ``get_extra_state`` carries it. 16 entries: the 4
    micro-batch forwards of each of 4 steps."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps, **kwargs)
        self.history = torch.zeros(16)

    def forward(self, x):
        if self.training:
            self.history = torch.cat([x.detach().abs().amax().reshape(1).float(), self.history[:-1]])
        return super().forward(x)

    def get_extra_state(self):
        return {"amax_history": self.history.clone()}

    def set_extra_state(self, state):
        self.history = state["amax_history"].clone()


def history_norm(hidden_size: int, *, kind: str, eps: float, topology=None, sequence_parallel: bool = False):
    return HistoryNorm(hidden_size, eps, topology=topology, sequence_parallel=sequence_parallel)


class HistoryBackend:
    @hookimpl
    def mtl_backends(self):
        return [dataclasses.replace(LOCAL_BACKEND, name="history", norm=history_norm,
                                    description="local, with norms keeping an amax history in extra state")]


@pytest.fixture
def history_backend():
    backend = HistoryBackend()
    plugins.register_plugin(backend, name="history-backend")
    yield
    plugins.unregister_plugin(backend)


def histories(result) -> dict[str, torch.Tensor]:
    models = [getattr(c, "module", c) for c in result.run.chunks]
    return {name: m.get_extra_state()["amax_history"] for name, m in modules_with_extra_state(models).items()}


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_continues_the_extra_state(history_backend, tmp_path, async_save):
    run = [*BASE, "model.backend='history'", f"ckpt.async_save={str(async_save).lower()}"]
    whole = train(load_config(None, [*run, "train.iters=4"]), progress=False)
    ckpt = [f"ckpt.save='{tmp_path}'"]
    first = train(load_config(None, [*run, "train.iters=2", *ckpt]), progress=False)
    resumed = train(load_config(None, [*run, "train.iters=4", *ckpt]), progress=False)
    expected, got = histories(whole), histories(resumed)
    assert len(expected) == 9  # 4 layers x 2 norms + the final norm
    assert all(expected[name][15] > 0 for name in expected)  # 4 steps x 4 micro-batches recorded
    # the first run recorded 8 forwards; the resumed run's last 8 entries are those, restored
    assert all(histories(first)[name][8] == 0 and histories(first)[name][7] > 0 for name in expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 2}


def test_checkpoint_without_extra_state_leaves_it_fresh(history_backend, tmp_path, caplog):
    ckpt = [f"ckpt.save='{tmp_path}'"]
    train(load_config(None, [*BASE, "train.iters=1", *ckpt]), progress=False)  # local: no extra state
    with caplog.at_level(logging.INFO, logger="mtl.train.checkpointing"):
        resumed = train(load_config(None, [*BASE, "model.backend='history'", "train.iters=2", *ckpt]),
                        progress=False)
    assert "extra state of 9 module(s) (e.g. FP8 amax histories) starts afresh, the checkpoint holds none" in caplog.text
    # one step (4 micro-batches) recorded since the resume, nothing before it
    assert all(h[3] > 0 and h[4] == 0 for h in histories(resumed).values())


def test_weights_only_load_restores_it_too(history_backend, tmp_path):
    run = [*BASE, "model.backend='history'"]
    saved = train(load_config(None, [*run, "train.iters=2", f"ckpt.save='{tmp_path / 'a'}'"]), progress=False)
    tuned = train(load_config(None, [*run, "train.iters=1", f"ckpt.load='{tmp_path / 'a'}'", "ckpt.load_optimizer=false"]),
                  progress=False)
    before, after = histories(saved), histories(tuned)
    for name in before:  # one step (4 forwards) recorded on top of the 8 loaded
        torch.testing.assert_close(after[name][4:12], before[name][:8], rtol=0, atol=0)


def test_another_layout_is_named():
    cfg = load_config(None, [*BASE, "parallel.tp=2"]).resolve(world_size=2, tokenizer_vocab_size=257)
    topology = type("T", (), {"world_size": 2})()
    saved = {"world_size": 2, "config": {"parallel": {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1}}}
    assert extra_state_layout_change(saved, cfg, topology) == "parallel.tp 1 -> 2"
    assert extra_state_layout_change({**saved, "world_size": 4}, cfg, topology) == "world size 4 -> 2"
    same = {"world_size": 2, "config": {"parallel": {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "ep": 1}}}
    assert extra_state_layout_change(same, cfg, topology) == ""
    piped = load_config(None, [*BASE, "parallel.pp=2"]).resolve(world_size=2, tokenizer_vocab_size=257)
    assert piped.parallel.virtual_stage_layers == [3, 1]  # by FLOPs, the default
    layout = {"tp": 1, "pp": 2, "vpp": 1, "cp": 1, "ep": 1}
    even = {"world_size": 2, "config": {"parallel": layout}}  # saved before the split by FLOPs existed
    assert extra_state_layout_change(even, piped, topology) == "layers per pipeline stage [2, 2] -> [3, 1]"
    by_hand = {"world_size": 2, "config": {"parallel": {**layout, "first_stage_layers": 3}}}
    assert extra_state_layout_change(by_hand, piped, topology) == ""


def straight_and_resumed_histories(ckpt: str) -> dict:
    """On each rank of a spawned run: the histories after 4 steps straight and after 2 + a resume for 2."""
    backend = HistoryBackend()
    plugins.register_plugin(backend, name="history-backend")
    run = [*BASE, "model.backend='history'", "parallel.pp=2", "train.iters=4"]
    straight = histories(train(load_config(None, run), progress=False))
    train(load_config(None, [*run, f"ckpt.save='{ckpt}'", "train.exit_interval=2"]), progress=False)
    resumed = histories(train(load_config(None, [*run, f"ckpt.load='{ckpt}'"]), progress=False))
    return {"straight": straight, "resumed": resumed}


def restaged_histories(ckpt: str) -> dict:
    """On each rank of a spawned run: the histories after 2 steps at stages of 2 + 2 layers, then
    a resume for 1 step at the default split by FLOPs, 3 + 1."""
    backend = HistoryBackend()
    plugins.register_plugin(backend, name="history-backend")
    run = [*BASE, "model.backend='history'", "parallel.pp=2", f"ckpt.save='{ckpt}'"]
    train(load_config(None, [*run, "train.iters=2", "parallel.pipeline_split='even'"]), progress=False)
    return histories(train(load_config(None, [*run, "train.iters=3"]), progress=False))


def test_restaged_pipeline_starts_the_extra_state_afresh(tmp_path):
    """Rank 1's first norms were layer 2's and are now layer 3's: the same names in its chunk.
    The extra state starts afresh rather than give a module another layer's history."""
    results = run_distributed(restaged_histories, 2, args=(str(tmp_path / "ckpt"),))
    assert [len(r) for r in results] == [6, 3]
    # one step (4 micro-batches) recorded since the resume, nothing before it
    assert all(h[3] > 0 and h[4] == 0 for r in results for h in r.values())


def test_each_pipeline_stage_resumes_its_own(tmp_path):
    # two stages hold different modules (the 4 layers as 3 + 1 by FLOPs: 6 norms; 2 + the final
    # norm): rows of different lengths, padded to the longest after the save's all-reduce
    results = run_distributed(straight_and_resumed_histories, 2, args=(str(tmp_path / "ckpt"),))
    assert [len(r["straight"]) for r in results] == [6, 3]
    for r in results:
        assert r["resumed"].keys() == r["straight"].keys()
        for name, history in r["straight"].items():
            assert history[15] > 0
            torch.testing.assert_close(r["resumed"][name], history, rtol=0, atol=0)
