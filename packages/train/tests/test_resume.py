"""Exact resume: 20 steps straight equal 10 steps, stop, resume for 10 (model, optimizer,
schedule, RNG and data position all restored)."""

import json

import pytest

from mtl.core.config_io import load_config
from mtl.core.errors import CheckpointError
from mtl.train.loop import train

from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")] + [
    "train.iters=20", "train.warmup_iters=3", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
]


def test_resume_gives_identical_losses(tmp_path):
    straight = train(load_config(None, [*BASE, f"logging.dir='{tmp_path / 'a'}'", "logging.callbacks=['jsonl']"]), progress=False)
    ckpt = tmp_path / "ckpt"
    first = train(load_config(None, [*BASE, f"ckpt.save='{ckpt}'", "train.exit_interval=10"]), progress=False)
    assert first.stopped_by == "exit_interval" and first.final_iteration == 10
    assert (ckpt / "latest").exists()
    second = train(load_config(None, [*BASE, f"ckpt.load='{ckpt}'", f"ckpt.save='{ckpt}'"]), progress=False)
    assert sorted(second.losses) == list(range(11, 21))
    for step in range(1, 11):
        assert first.losses[step] == straight.losses[step]
    for step in range(11, 21):
        assert second.losses[step] == straight.losses[step], step
    # metrics.jsonl: one object per logged step with the contract's keys
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu"} <= set(rows[0])
    assert [r["loss"] for r in rows] == [straight.losses[step] for step in range(1, 21)]


def test_resume_into_a_different_model_shape_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(load_config(None, [*BASE, "train.iters=2", "train.warmup_iters=0", f"ckpt.save='{ckpt}'"]), progress=False)
    with pytest.raises(CheckpointError, match=r"model.hidden_size: 32 -> 64"):
        train(load_config(None, [*BASE, "train.iters=4", "train.warmup_iters=0", "model.hidden_size=64", f"ckpt.load='{ckpt}'"]), progress=False)


def test_rng_states_are_not_restored_across_expert_parallel_sizes():
    # same world size, another ep: a rank's expert RNG stream would belong to another ep rank
    from mtl.train.layout_change import same_rng_layout

    cfg = load_config(None, [*BASE, "model.num_layers=2", "model.num_experts=4", "model.moe_top_k=2",
                             "parallel.ep=2"]).resolve(world_size=2, tokenizer_vocab_size=257)
    saved = {"world_size": 2, "device_type": "cpu", "config": cfg.to_dict()}
    topology = type("T", (), {"world_size": 2})()
    assert same_rng_layout(saved, cfg, topology, "cpu")
    saved["config"]["parallel"]["ep"] = 1
    assert not same_rng_layout(saved, cfg, topology, "cpu")
