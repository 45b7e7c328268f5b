"""Acceptance: the fp8 backend trains the tiny model on real text as well as fp32 does.

200 steps on the demo corpus (byte tokenizer) from the same weights and batches: the
validation loss after them (16 batches held out) under FP8 current scaling is within 2% of
the fp32 local backend's (other recipes: see BOUNDS), and fp32 learned (well below the uniform
distribution's ln 257 = 5.55). A training step's loss is too noisy for a 2% bound (64 tokens)."""

import pytest

from mtl.core.config_io import load_config
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess
from mtl.train.loop import train
from mtl.train.testing import TINY

STEPS = 200


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


# The acceptance bound is 2%, met by per-tensor current scaling (measured: 2.503 vs fp32's
# 2.506). Measured on this model: delayed 2.585 (+3.2%: the history's stale scales), row-wise
# 2.658 (+6%; with the input-gradient GEMM in high precision it is 2.490, with the output
# gradient scaled per tensor there 2.537: the per-token gradient scale is what costs, an open
# item); their bounds say so rather than hide it. fp32 moves 0.3% under a perturbed adam_eps.
BOUNDS = {"current": 0.02, "delayed": 0.05, "rowwise": 0.08}


@pytest.fixture(scope="module")
def fp32_loss(corpus):
    return final_loss(corpus, ["model.backend='local'"])


@pytest.mark.parametrize("recipe", list(BOUNDS))
def test_fp8_loss_close_to_fp32(corpus, fp32_loss, recipe):
    fp8 = final_loss(corpus, ["model.backend='fp8'", f"train.fp8='{recipe}'"])
    assert fp32_loss < 3.0, f"fp32 did not learn: {fp32_loss}"
    assert abs(fp8 - fp32_loss) <= BOUNDS[recipe] * fp32_loss, f"fp8 {recipe}: {fp8:.4f} vs fp32 {fp32_loss:.4f}"
