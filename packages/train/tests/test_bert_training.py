"""The ``bert`` family trains through ``mtl.train.loop.train`` (what ``mtl train`` runs) like
one process at tp2+sp, pp2, cp2, dp2 + distributed optimizer and tp2 x pp2: the first 3 losses
within 1e-5 relative and every gradient within the gpt layout tests' tolerances. A post-norm
BERT with token types and the binary head, BERT's real vocabulary (30522 rows, padded
differently at tp 1 and 2), samples with padding."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mtl.core import plugins
from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import DatasetSpec
from mtl.parallel.testing import run_distributed
from mtl.train.testing import LOSS_RTOL, StepWatcher, compare_with_reference, run_tiny

# Until mtl-data's ``bert`` dataset is merged: a WordPiece tokenizer.json of BERT's real size and
# a dataset ``bert_test_samples`` whose samples carry BERTMaskedWordPieceDataset's fields and
# conventions (labels -1 where nothing is predicted, padding_mask 1 on real tokens, pads = id 0,
# sentence pairs with token types 0/1, 15% of the real tokens masked).
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_VOCAB = 30522
PAD, CLS, SEP, MASK = 0, 2, 3, 4


def write_wordpiece_tokenizer(directory: Path, vocab_size: int = BERT_VOCAB, specials=SPECIALS) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece

    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    path = Path(directory) / "tokenizer.json"
    Tokenizer(WordPiece(vocab, unk_token="[UNK]")).save(str(path))
    return path


class BertSamples(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed = [seed, ("train", "valid", "test").index(split)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng([*self.seed, idx])
        s = self.seq_length
        real = int(rng.integers(s // 2, s + 1))  # some samples padded, some full
        first = (real - 3) // 2
        words = rng.integers(len(SPECIALS), self.vocab_size, real - 3)
        text = np.concatenate([[CLS], words[:first], [SEP], words[first:], [SEP], np.full(s - real, PAD)])
        types = np.concatenate([np.zeros(first + 2), np.ones(real - first - 2), np.zeros(s - real)])
        word_positions = np.array([i for i in range(real) if text[i] not in (CLS, SEP)])
        masked = rng.choice(word_positions, max(1, round(0.15 * len(word_positions))), replace=False)
        labels = np.full(s, -1)
        labels[masked] = text[masked]
        text[masked] = MASK
        loss_mask = np.zeros(s)
        loss_mask[masked] = 1
        return {"text": text.astype(np.int64), "types": types.astype(np.int64), "labels": labels,
                "is_random": int(rng.integers(0, 2)), "padding_mask": (np.arange(s) < real).astype(np.int64),
                "loss_mask": loss_mask, "truncated": 0}


class BertSamplesPlugin:
    @hookimpl
    def mtl_datasets(self):
        def build(config, tokenizer, split, num_samples=None):
            return BertSamples(num_samples or 256, config.model.seq_length, tokenizer.vocab_size, config.train.seed, split)

        return [DatasetSpec("bert_test_samples", build, "BERT-shaped random samples (tests)")]


PLUGIN = BertSamplesPlugin()



BERT = [
    "model.family='bert'", "model.norm_position='post'", "model.type_vocab_size=2", "model.binary_head=true",
    "model.num_query_groups=4", "model.normalization='layernorm'", "model.norm_eps=1e-12",
    "model.activation='gelu'", "model.position_embedding='learned'", "model.bias=true",
    "data.dataset='bert_test_samples'", "data.tokenizer='hf'",
]
LAYOUTS = {
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", "parallel.pipeline_split='even'"]),
    "cp2": (2, ["parallel.cp=2"]),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
}


def bert_run(overrides, tokenizer):
    """run_tiny's result, plus the metrics each logged step reported (on the logging rank)."""
    plugins.register_plugin(PLUGIN, name="bert-test-samples")
    with_grads = not any(o.startswith("train.iters") for o in overrides)  # the resume runs need losses only
    logged = {}
    with StepWatcher("bert-metrics", lambda step, metrics: logged.update({step: dict(metrics)})):
        watch = ["logging.callbacks=['bert-metrics']", "logging.interval=1"]
        result = run_tiny([*BERT, f"data.tokenizer_model='{tokenizer}'", *overrides, *watch], with_grads)
    return {**result, "logged": logged}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(write_wordpiece_tokenizer(tmp_path_factory.mktemp("wordpiece")))


@pytest.fixture(scope="module")
def reference(tokenizer):
    (result,) = run_distributed(bert_run, 1, args=([], tokenizer))
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"].values())
    for step, metrics in result["logged"].items():  # the loss is the MLM loss plus the binary head's
        assert 0.0 <= metrics["mlm_accuracy"] <= 1.0
        assert metrics["loss"] == pytest.approx(metrics["mlm_loss"] + metrics["binary_loss"], rel=1e-6)
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bert_layout_matches_single_process(layout, reference, tokenizer):
    world, overrides = LAYOUTS[layout]
    results = run_distributed(bert_run, world, args=(overrides, tokenizer))
    compare_with_reference(layout, results, reference)
    logged = next(r["logged"] for r in results if r["logged"])
    for step, metrics in reference["logged"].items():  # the accuracy over the TP-split vocabulary, cp-split tokens
        assert logged[step]["mlm_accuracy"] == pytest.approx(metrics["mlm_accuracy"], abs=1e-6), (layout, step)


def test_bert_saved_at_tp2_sp_resumes_at_pp2(tokenizer, tmp_path):
    """Steps 4-6 resumed at pp2 from a tp2+sp checkpoint of step 3 equal a straight 6-step run."""
    six = ["train.iters=6"]
    (straight,) = run_distributed(bert_run, 1, args=(six, tokenizer))
    ckpt = f"ckpt.save='{tmp_path / 'ckpt'}'"
    run_distributed(bert_run, 2, args=([*six, *LAYOUTS["tp2_sp"][1], ckpt, "train.exit_interval=3"], tokenizer))
    resumed = run_distributed(bert_run, 2, args=([*six, *LAYOUTS["pp2"][1], ckpt], tokenizer))
    losses = next(r["losses"] for r in resumed if r["last_stage"])
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(losses[step] - straight["losses"][step]) <= LOSS_RTOL * abs(straight["losses"][step])
