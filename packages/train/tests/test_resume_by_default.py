"""Resume by default: the same command run twice continues the run (losses equal a straight
run's, bit for bit); ``ckpt.resume = false`` (``--fresh``) starts over only into an empty
directory; a ``ckpt.save`` directory of another run (model or data) is refused before any
compute, naming the difference; a changed schedule length is one warning line; an
exception inside a step leaves ``latest`` on the last complete checkpoint."""

import logging
import os
import signal

import pytest

from mtl.core import plugins
from mtl.core.config_io import load_config
from mtl.core.errors import CheckpointError
from mtl.core.hookspecs import hookimpl
from mtl.core.plugins import registry
from mtl.core.registrations import DatasetSpec
from mtl.train.loop import train
from mtl.train.testing import TINY, StepWatcher

BASE = [o for o in TINY if not o.startswith("train.iters")] + ["train.iters=8", "train.warmup_iters=2"]


def messages(records, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= level]


def run(overrides, **kw):
    return train(load_config(None, [*BASE, *overrides]), progress=False, **kw)


def test_the_same_command_twice_resumes_and_equals_a_straight_run(tmp_path, mtl_log):
    straight = run([])
    command = [f"ckpt.save='{tmp_path / 'ckpt'}'", "train.exit_interval=4"]
    first = run(command)
    assert first.stopped_by == "exit_interval" and sorted(first.losses) == [1, 2, 3, 4]
    mtl_log.clear()
    second = run(command)  # the very same config: no ckpt.load
    assert sorted(second.losses) == [5, 6, 7, 8]
    assert {**first.losses, **second.losses} == straight.losses  # bit for bit
    resumed = [m for m in messages(mtl_log) if m.startswith("resuming")]
    assert resumed == [f"resuming at iteration 4 from {tmp_path / 'ckpt' / 'iter_0000004'} (ckpt.save holds this "
                       "run's checkpoints; --fresh starts over in an empty directory)"]
    third = run(command)  # finished: nothing to train, nothing saved twice
    assert third.losses == {} and third.final_iteration == 8
    assert any("nothing to train" in m for m in messages(mtl_log))


def test_fresh_only_into_an_empty_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    fresh = run([f"ckpt.save='{ckpt}'", "ckpt.resume=false", "train.iters=2"])
    assert sorted(fresh.losses) == [1, 2]
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(latest iteration 2\).*--fresh"):
        run([f"ckpt.save='{ckpt}'", "ckpt.resume=false", "train.iters=2"])


@pytest.mark.parametrize("change, named", [
    ("model.hidden_size=64", "model.hidden_size: 32 -> 64"),
    ("data.mock_num_samples=1000", "data.mock_num_samples: 4096 -> 1000"),
    ("data.split='90,5,5'", "data.split: '98,1,1' -> '90,5,5'"),
])
def test_another_runs_directory_is_refused_before_step_one(tmp_path, change, named):
    ckpt = tmp_path / "ckpt"
    run([f"ckpt.save='{ckpt}'", "train.iters=2"])
    logs = tmp_path / "logs"
    with pytest.raises(CheckpointError, match="another run") as info:
        run([f"ckpt.save='{ckpt}'", change, f"logging.dir='{logs}'", "logging.callbacks=['jsonl']"])
    assert named in str(info.value) and "ckpt.save = NEW_DIR" in str(info.value)
    assert not logs.exists()  # refused before any step (and before the metrics file)
    assert (ckpt / "latest").read_text().strip() == "2"


def test_ckpt_load_names_another_source_and_a_longer_schedule_is_one_warning(tmp_path, mtl_log):
    source = tmp_path / "source"
    run([f"ckpt.save='{source}'", "train.iters=4"])
    mtl_log.clear()
    longer = run([f"ckpt.load='{source}'", f"ckpt.save='{tmp_path / 'next'}'", "train.iters=6"])
    assert sorted(longer.losses) == [5, 6]
    warnings = messages(mtl_log, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "train.iters: 4 -> 6" in warnings[0] and "iteration 4" in warnings[0]


class FailingDataset:
    """The mock dataset, but reading sample ``fail_at`` raises (a corrupt shard, a dead disk)."""

    def __init__(self, fail_at: int):
        self.fail_at = fail_at

    def build(self, config, tokenizer, split, num_samples=None):
        inner = registry("dataset").get("mock").build(config, tokenizer, split, num_samples)
        fail_at = self.fail_at if split == "train" else None

        class Failing:
            def __len__(self):
                return len(inner)

            def __getitem__(self, index):
                if index == fail_at:
                    raise OSError(f"sample {index} is unreadable")
                return inner[index]

        return Failing()

    @hookimpl
    def mtl_datasets(self):
        return [DatasetSpec("failing", self.build)]


@pytest.fixture
def failing_dataset():
    plugin = FailingDataset(fail_at=5 * 8 + 3)  # inside step 6 (global batch 8)
    plugins.register_plugin(plugin, name="failing-dataset")
    yield plugin
    plugins.unregister_plugin(plugin)


def test_an_exception_in_a_step_saves_nothing(tmp_path, failing_dataset):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(OSError, match="sample 43 is unreadable"):
        run([f"ckpt.save='{ckpt}'", "ckpt.interval=4", "data.dataset='failing'"])
    assert (ckpt / "latest").read_text().strip() == "4"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000004", "latest"]


def test_interval_minutes_saves_by_the_clock(tmp_path):
    from mtl.ckpt.directory import committed_iterations

    ckpt = tmp_path / "ckpt"
    # 0.00001 minutes: every step is past it, so every step saves (none by ckpt.interval)
    run([f"ckpt.save='{ckpt}'", "ckpt.interval_minutes=0.00001", "train.iters=3"])
    assert committed_iterations(str(ckpt)) == [1, 2, 3]
    with pytest.raises(Exception, match="ckpt.interval_minutes = -1.0 must not be negative"):
        run([f"ckpt.save='{tmp_path / 'x'}'", "ckpt.interval_minutes=-1"])


def ctrl_c_at(at: int):
    """At logged step ``at``, a real SIGINT to this process, as a user pressing Ctrl-C sends."""

    def on_step(step, metrics):
        if step == at:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


@pytest.mark.parametrize("save_on_exit", [True, False])
def test_ctrl_c_saves_its_step_unless_save_on_exit_is_false(tmp_path, save_on_exit):
    with StepWatcher("ctrl_c", ctrl_c_at(3)):
        result = run([f"ckpt.save='{tmp_path}'", f"ckpt.save_on_exit={str(save_on_exit).lower()}",
                      "logging.callbacks=['ctrl_c']"])
    # the signal came after step 3's agreement between ranks: step 4 is where all stop
    assert result.stopped_by == "signal" and result.final_iteration == 4
    assert (tmp_path / "latest").exists() == save_on_exit
    if save_on_exit:
        assert (tmp_path / "latest").read_text().strip() == "4"
