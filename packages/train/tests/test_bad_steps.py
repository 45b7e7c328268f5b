"""Bad steps handled, not hidden: a NaN loss on one rank of a dp=2 run stops both ranks at that
step with the same message (step, the rank it started on, the last good checkpoint), saving
nothing; ``train.skip_bad_steps = N`` skips up to N such steps (no update) and counts them.

The NaN comes from a model family registered the way a third party would (``gpt`` plus a
forward hook that poisons the loss of one training step on one rank)."""

import math

import pytest

from mtl.core import plugins
from mtl.core.config_io import load_config
from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import ModelFamily
from mtl.parallel.testing import run_distributed
from mtl.train.health import NonFiniteError
from mtl.train.loop import train
from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")] + ["train.iters=6", "model.family='gpt_nan'"]


class PoisonedGPT:
    """Family ``gpt_nan``: the gpt family whose loss is NaN in training forward passes of step
    ``at_step`` (counted per rank) on rank ``on_rank``."""

    def __init__(self, at_step: int, on_rank: int, micro_batches: int):
        self.at_step, self.on_rank, self.micro_batches = at_step, on_rank, micro_batches

    def build(self, config, topology, backend, **kwargs):
        from mtl.models.gpt import build_gpt

        model = build_gpt(config, topology, backend, **kwargs)
        calls = {"n": 0}

        def poison(module, args, output):
            if not module.training or topology.rank != self.on_rank:
                return None
            calls["n"] += 1
            step = (calls["n"] - 1) // self.micro_batches + 1
            return output * float("nan") if step == self.at_step else None

        model.register_forward_hook(poison)
        return model

    @hookimpl
    def mtl_model_families(self):
        return [ModelFamily("gpt_nan", self.build)]


def train_poisoned(overrides: list[str], at_step: int, on_rank: int, micro_batches: int) -> dict:
    plugin = PoisonedGPT(at_step, on_rank, micro_batches)
    plugins.register_plugin(plugin, name="gpt-nan")
    try:
        result = train(load_config(None, [*BASE, *overrides]), progress=False)
        return {"losses": result.losses, "bad_steps": result.bad_steps, "error": None}
    except NonFiniteError as exc:
        return {"error": str(exc)}
    finally:
        plugins.unregister_plugin(plugin)


def test_nan_on_one_rank_stops_every_rank_naming_step_rank_and_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # dp=2: 2 micro-batches of 2 per rank and step (global batch 8)
    results = run_distributed(train_poisoned, 2, args=([f"ckpt.save='{ckpt}'", "ckpt.interval=2"], 3, 1, 2))
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "non-finite loss" in errors[0] and "at step 3" in errors[0], errors[0]
    assert "first seen in rank 1's loss" in errors[0], errors[0]
    assert f"Last good checkpoint: {ckpt / 'iter_0000002'}" in errors[0], errors[0]
    assert "train.skip_bad_steps" in errors[0]
    assert (ckpt / "latest").read_text().strip() == "2"  # nothing saved at or after the bad step
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest"]


def test_skip_bad_steps_skips_and_counts(tmp_path):
    short = ["train.skip_bad_steps=1", "train.iters=4"]
    clean = train_poisoned(short, at_step=99, on_rank=0, micro_batches=4)
    skipped = train_poisoned(short, at_step=2, on_rank=0, micro_batches=4)
    assert skipped["error"] is None and skipped["bad_steps"] == 1 and clean["bad_steps"] == 0
    assert math.isnan(skipped["losses"][2])
    # the bad step changed nothing: step 3 sees the weights step 1 left (so it differs from the
    # clean run's step 3, which followed an update at step 2), and the run goes on finite
    assert [s for s in skipped["losses"] if math.isfinite(skipped["losses"][s])] == [1, 3, 4]
    assert skipped["losses"][1] == clean["losses"][1]
    assert skipped["losses"][3] != clean["losses"][3]


def test_more_bad_steps_than_allowed_stop_the_run():
    result = train_poisoned(["train.skip_bad_steps=0"], at_step=2, on_rank=0, micro_batches=4)
    assert result["error"] is not None
    assert "at step 2" in result["error"] and "Last good checkpoint: none" in result["error"]
    assert "set train.skip_bad_steps = N" in result["error"]


@pytest.mark.parametrize("bad", ["-1"])
def test_negative_skip_is_a_config_error(bad):
    from mtl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="train.skip_bad_steps = -1 must not be negative"):
        load_config(None, [*BASE, f"train.skip_bad_steps={bad}"]).resolve(tokenizer_vocab_size=257)
