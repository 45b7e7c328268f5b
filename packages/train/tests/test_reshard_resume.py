"""Any layout resumes any other: a checkpoint saved at tp=2 x pp=2 (or at dp=2 under the
distributed optimizer) at step 10 of 20 resumes at other layouts (including another pipeline
split), and steps 11-20 equal a straight 20-step run within 1e-5 relative. Weights-only starts
(ckpt.load_optimizer = false, ckpt.finetune_from) take the weights from any layout and begin at
iteration 0."""

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.models.param_layout import gather_global_state
from mtl.parallel.testing import run_distributed
from mtl.train.loop import train
from mtl.train.testing import LOSS_RTOL, TINY

BASE = [o for o in TINY if not o.startswith("train.iters")] + ["train.iters=20", "train.warmup_iters=3"]
SAVE_LAYOUTS = {"tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
                "dp2_distopt": (2, ["parallel.distributed_optimizer=true"])}
RESUME_LAYOUTS = {"single": (1, []), "tp2": (2, ["parallel.tp=2"]), "pp2": (2, ["parallel.pp=2"]),
                  "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
                  # the pipeline rebalanced on resume: 2 layers and 2 where the checkpoint had 3 and 1
                  # (tp2_pp2 saves with the default split by FLOPs; test_the_save_is_split_by_flops)
                  "pp2_rebalanced": (2, ["parallel.pp=2", "parallel.virtual_stage_layers=[2, 2]"])}


def run(overrides: list[str]) -> dict:
    result = train(load_config(None, [*BASE, *overrides]), progress=False)
    weights = {}
    for chunk in result.run.chunks:
        weights.update(gather_global_state(getattr(chunk, "module", chunk), result.run.topology))
    return {"losses": result.losses, "last_stage": result.run.topology.is_last_stage,
            "final_iteration": result.final_iteration, "weights": weights}


def launch(world: int, overrides: list[str]) -> dict:
    """The last stage's losses and every stage's full weights."""
    results = run_distributed(run, world, args=(overrides,))
    weights = {name: w for r in results for name, w in r["weights"].items()}
    last = next(r for r in results if r["last_stage"])
    return {**last, "weights": weights}


@pytest.fixture(scope="module")
def straight():
    return launch(1, [])["losses"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """layout -> checkpoint directory holding iteration 10."""
    root = tmp_path_factory.mktemp("reshard")
    dirs = {}
    for name, (world, overrides) in SAVE_LAYOUTS.items():
        dirs[name] = str(root / name)
        first = launch(world, [*overrides, f"ckpt.save='{dirs[name]}'", "train.exit_interval=10"])
        assert first["final_iteration"] == 10
    return dirs


def test_the_save_is_split_by_flops():
    """``pp2_rebalanced`` resumes at another split only if tp2_pp2 saved with 3 + 1 layers."""
    world, overrides = SAVE_LAYOUTS["tp2_pp2"]
    cfg = load_config(None, [*BASE, *overrides]).resolve(world_size=world, tokenizer_vocab_size=257)
    assert cfg.parallel.virtual_stage_layers == [3, 1]


@pytest.mark.parametrize("source, target", [
    ("tp2_pp2", "single"), ("tp2_pp2", "tp2"), ("tp2_pp2", "pp2"), ("tp2_pp2", "dp2_distopt"),
    ("tp2_pp2", "pp2_rebalanced"),
    ("dp2_distopt", "single"), ("dp2_distopt", "tp2"),
])
def test_resume_at_another_layout_continues_the_run(source, target, saved, straight):
    world, overrides = RESUME_LAYOUTS[target]
    resumed = launch(world, [*overrides, f"ckpt.load='{saved[source]}'"])["losses"]
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        assert abs(resumed[step] - straight[step]) <= LOSS_RTOL * abs(straight[step]), (step, resumed[step], straight[step])


@pytest.mark.parametrize("how", ["load_optimizer_false", "finetune_from"])
def test_weights_only_start_from_a_tp2_checkpoint_at_tp1(how, tmp_path):
    ckpt = str(tmp_path / "tp2")
    at_save = launch(2, ["parallel.tp=2", "train.iters=4", "train.warmup_iters=0", f"ckpt.save='{ckpt}'"])
    start = ([f"ckpt.load='{ckpt}'", "ckpt.load_optimizer=false"] if how == "load_optimizer_false"
             else [f"ckpt.finetune_from='{ckpt}'", f"ckpt.load='{tmp_path / 'empty'}'"])
    # lr 0: the weights stay as loaded, so they can be compared after the run
    tuned = launch(1, [*start, "train.iters=2", "train.warmup_iters=0", "train.lr=0.0"])
    assert sorted(tuned["losses"]) == [1, 2]  # iteration 0, not 4
    assert tuned["weights"].keys() == at_save["weights"].keys()
    for name, weight in at_save["weights"].items():
        assert torch.equal(tuned["weights"][name], weight), name
