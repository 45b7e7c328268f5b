"""Acceptance: the fp8 backend trains the tiny model on real text as fp32 does.

60 steps on the demo corpus (byte tokenizer) from the same weights and batches; the validation
loss after them (16 batches held out) under each FP8 recipe is within BOUND of the fp32 local
backend's, and an FP8 path with a broken scale is not.

Why 60 steps and not more: this model's final loss is chaotic past ~80 steps. At 200 steps the
FP8 - fp32 gap swung from -3% to +12% over seeds 1-6 for every recipe, identically at the commit
that set the old 2% bound (e0cb8f7) and at f5d8277, and fp32 alone moved 0.3-0.5% between two
CPUs: the old test measured the CPU, not FP8 (issue 33). At 60 steps, measured on seeds 1-12
(36 runs, torch 2.13 CPU, 2026-11-27), every recipe's gap lay within -0.6%..+1.0%, while a scale
8x too small (saturating the large values) gave +2.1%..+5.5% and 16x too small +5.5%..+10.8%."""

import pytest

from mtl.core.config_io import load_config
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess
from mtl.train.loop import train
from mtl.train.testing import TINY

STEPS = 60
# 2.5x the largest working gap measured, half the smallest gap of the broken scale below
BOUND = 0.025


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    work = tmp_path_factory.mktemp("corpus")
    write_demo_corpus(str(work / "demo.jsonl"), num_docs=400, seed=0)
    preprocess(str(work / "demo.jsonl"), str(work / "demo"), "byte", append_eod=True, progress=False)
    return work


def final_loss(corpus, overrides):
    base = [o for o in TINY if not o.startswith(("train.iters", "data.dataset", "train.global_batch_size", "train.lr="))]
    config = load_config(None, [
        *base, f"train.iters={STEPS}", "train.global_batch_size=4", "train.lr=3e-3", "train.min_lr=3e-4",
        "data.dataset='gpt'", f"data.paths=['{corpus / 'demo'}']", f"data.cache_dir='{corpus / 'cache'}'",
        f"train.eval_interval={STEPS}", "train.eval_iters=16", *overrides,
    ])
    return train(config, progress=False).eval_losses[STEPS]


@pytest.fixture(scope="module")
def fp32_loss(corpus):
    loss = final_loss(corpus, ["model.backend='local'"])
    assert loss < 3.3, f"fp32 did not learn: {loss} (uniform over 257 tokens: 5.55)"
    return loss


def gap(fp8_loss: float, fp32_loss: float) -> float:
    return abs(fp8_loss - fp32_loss) / fp32_loss


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
def test_fp8_loss_close_to_fp32(corpus, fp32_loss, recipe):
    fp8 = final_loss(corpus, ["model.backend='fp8'", f"train.fp8='{recipe}'"])
    assert gap(fp8, fp32_loss) <= BOUND, f"fp8 {recipe}: {fp8:.4f} vs fp32 {fp32_loss:.4f}"


def test_broken_scale_fails_the_bound(corpus, fp32_loss, monkeypatch):
    """The check can fail: current scaling with every scale 16x too small (values above a
    sixteenth of the amax saturate) lands outside the bound."""
    import mtl.quant.layers

    right = mtl.quant.layers.scale_from_amax
    monkeypatch.setattr(mtl.quant.layers, "scale_from_amax", lambda *args: right(*args) / 16)
    fp8 = final_loss(corpus, ["model.backend='fp8'", "train.fp8='current'"])
    assert gap(fp8, fp32_loss) > BOUND, f"a broken scale passed: {fp8:.4f} vs fp32 {fp32_loss:.4f}"
