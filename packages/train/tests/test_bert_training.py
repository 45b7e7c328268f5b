"""The ``bert`` family trains through ``mtl.train.loop.train`` (what ``mtl train`` runs) like
one process at tp2+sp, pp2, cp2, dp2 + distributed optimizer and tp2 x pp2: the first 3 losses
within 1e-5 relative and every gradient within the gpt layout tests' tolerances; a checkpoint
saved at one layout resumes at another. A post-norm BERT with token types and the binary head
on mtl-data's ``bert`` dataset (Megatron's samples: sentence pairs, 80/10/10 masking, padding)
over a sentence-split corpus, with a WordPiece vocabulary of BERT's real size (30522 rows,
padded differently at tp 1 and 2)."""

import json
import math

import pytest

from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess
from mtl.parallel.testing import run_distributed
from mtl.train.testing import (LOSS_RTOL, StepWatcher, compare_with_reference, run_grouped, run_tiny,
                               write_sized_wordpiece)

BERT_VOCAB = 30522  # bert-base-uncased's vocabulary size
ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
BERT = [
    "model.family='bert'", "model.norm_position='post'", "model.type_vocab_size=2", "model.binary_head=true",
    "model.num_query_groups=4", "model.normalization='layernorm'", "model.norm_eps=1e-12",
    "model.activation='gelu'", "model.position_embedding='learned'", "model.bias=true", "model.seq_length=32",
    "data.dataset='bert'", "data.tokenizer='hf'", "data.split='90,5,5'",
]
LAYOUTS = {
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", "parallel.pipeline_split='even'"]),
    "cp2": (2, ["parallel.cp=2"]),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
}


def bert_run(overrides, corpus):
    """run_tiny's result, plus the metrics each logged step reported (on the logging rank)."""
    prefix, tokenizer = corpus
    with_grads = "train.exit_interval=3" in overrides  # the layouts' gradients; the resume runs need losses only
    logged = {}
    with StepWatcher("bert-metrics", lambda step, metrics: logged.update({step: dict(metrics)})):
        watch = ["logging.callbacks=['bert-metrics']", "logging.interval=1"]
        data = [f"data.tokenizer_model='{tokenizer}'", f"data.paths=['{prefix}']"]
        result = run_tiny([*BERT, *data, *overrides, *watch], with_grads)
    return {**result, "logged": logged}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(prefix, tokenizer.json): the demo corpus preprocessed with sentence splits."""
    root = tmp_path_factory.mktemp("bert_corpus")
    jsonl = write_demo_corpus(str(root / "corpus.jsonl"), num_docs=200, seed=3)
    texts = [json.loads(line)["text"] for line in open(jsonl, encoding="utf-8")]
    tokenizer = str(write_sized_wordpiece(root, texts, BERT_VOCAB, ROLES))
    preprocess(jsonl, str(root / "corpus"), "hf", tokenizer, progress=False, split_sentences=True)
    return str(root / "corpus"), tokenizer


# Every run follows the same 6-step schedule; the layouts stop after 3 (a run's first half).
FIRST_HALF = ["train.iters=6", "train.exit_interval=3"]


@pytest.fixture(scope="module")
def reference(corpus):
    (result,) = run_distributed(bert_run, 1, args=(FIRST_HALF, corpus))
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"].values())
    for step, metrics in result["logged"].items():  # the loss is the MLM loss plus the binary head's
        assert 0.0 <= metrics["mlm_accuracy"] <= 1.0
        assert metrics["loss"] == pytest.approx(metrics["mlm_loss"] + metrics["binary_loss"], rel=1e-6)
    return result


def bert_runs(runs: list[list[str]], corpus) -> list[dict]:
    return [bert_run(overrides, corpus) for overrides in runs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("bert_ckpt") / "ckpt"


@pytest.fixture(scope="module")
def layout_results(corpus, checkpoint):
    """Every layout's results, those of one world size from one spawn; tp2_sp also saves its
    step 3 to ``checkpoint``."""
    return run_grouped({name: (world, [*FIRST_HALF, *overrides, *([f"ckpt.save='{checkpoint}'"] if name == "tp2_sp" else [])])
                        for name, (world, overrides) in LAYOUTS.items()}, bert_runs, args=(corpus,))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bert_layout_matches_single_process(layout, reference, layout_results):
    results = layout_results[layout]
    compare_with_reference(layout, results, reference)
    logged = next(r["logged"] for r in results if r["logged"])
    for step, metrics in reference["logged"].items():  # over the TP-split vocabulary and cp-split tokens
        assert logged[step]["mlm_accuracy"] == pytest.approx(metrics["mlm_accuracy"], abs=1e-6), (layout, step)


def test_bert_saved_at_tp2_sp_resumes_at_pp2(corpus, checkpoint, layout_results):
    """Steps 4-6 resumed at pp2 from the tp2+sp checkpoint of step 3 equal a straight 6-step run."""
    (straight,) = run_distributed(bert_run, 1, args=(["train.iters=6"], corpus))
    resumed = run_distributed(bert_run, 2, args=(["train.iters=6", *LAYOUTS["pp2"][1], f"ckpt.save='{checkpoint}'"],
                                                 corpus))
    losses = next(r["losses"] for r in resumed if r["last_stage"])
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(losses[step] - straight["losses"][step]) <= LOSS_RTOL * abs(straight["losses"][step])
