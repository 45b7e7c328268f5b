"""Fine-tuning a converted BERT into a sequence classifier: a Hugging Face BertForMaskedLM
(BERT's 30522-token WordPiece vocabulary) converted by ``mtl convert``, then ``mtl train`` with
``ckpt.finetune_from`` and ``model.num_labels = 2`` on a JSONL task whose label is the
vocabulary its words come from. The encoder loads, the pooler and classifier start fresh (one log line), the loss falls
and the accuracy rises; tp=2 trains the same model as one process (losses within 1e-5)."""

import io
import json
import logging
import random

import pytest
import torch

from mtl.parallel.testing import run_distributed
from mtl.train.testing import LOSS_RTOL, assemble, run_tiny, write_sized_wordpiece

transformers = pytest.importorskip("transformers")

BERT_VOCAB = 30522
ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
# a class per vocabulary: what any encoder's [CLS] summary separates after a few steps
CLASS_WORDS = ("red green blue black white yellow".split(), "cat dog bird fish horse mouse".split())
# the converted model's settings (what its config.json says), and the fine-tuning task's
MODEL = {"family": "'bert'", "norm_position": "'post'", "type_vocab_size": 2, "num_layers": 2, "hidden_size": 32,
         "num_attention_heads": 4, "num_query_groups": 4, "ffn_hidden_size": 64, "normalization": "'layernorm'",
         "norm_eps": 1e-12, "activation": "'gelu'", "position_embedding": "'learned'", "bias": "true",
         "max_position_embeddings": 32, "seq_length": 16, "num_labels": 2}


def task_line(rng: random.Random) -> dict:
    label = rng.randrange(2)
    return {"text": " ".join(rng.choice(CLASS_WORDS[label]) for _ in range(rng.randint(3, 12))), "label": label}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(converted checkpoint, tokenizer.json, train.jsonl)."""
    from click.testing import CliRunner

    from mtl.cli.main import cli

    root = tmp_path_factory.mktemp("bert_finetune")
    rng = random.Random(0)
    lines = [task_line(rng) for _ in range(400)]
    (root / "task.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    hf_dir = root / "hf"
    hf_dir.mkdir()
    texts = [line["text"] for line in lines] * 3
    tokenizer = write_sized_wordpiece(hf_dir, texts, BERT_VOCAB, ROLES)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=BERT_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    transformers.BertForMaskedLM(config).save_pretrained(hf_dir)
    result = CliRunner().invoke(cli, ["convert", "--from", "hf", "--to", "mtl", str(hf_dir), str(root / "pretrained")])
    assert result.exit_code == 0, result.output
    return root / "pretrained", tokenizer, root / "task.jsonl"


def overrides(pretrained, extra=()) -> list[str]:
    ckpt, tokenizer, task = pretrained
    return [*(f"model.{key}={value}" for key, value in MODEL.items()),
            "data.dataset='classification'", "data.tokenizer='hf'", f"data.tokenizer_model='{tokenizer}'",
            f"data.paths=['{task}']", "data.split='90,10,0'", f"ckpt.finetune_from='{ckpt}'",
            "train.micro_batch_size=8", "train.global_batch_size=16", "train.seed=3", "train.weight_decay=0.0",
            *extra]


FINETUNE = ["train.iters=12", "train.lr=1e-2", "train.lr_schedule='constant'", "train.eval_interval=0"]


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
    """``mtl train`` from the converted checkpoint: (its output and log, the metrics of each step)."""
    from click.testing import CliRunner

    from mtl.cli.main import cli

    logs = tmp_path_factory.mktemp("finetune_logs")
    sets = overrides(pretrained, [*FINETUNE, "train.device='cpu'", f"logging.dir='{logs}'", "train.eval_interval=12",
                                  "train.eval_iters=2"])
    handler = logging.StreamHandler(io.StringIO())
    logging.getLogger("mtl").addHandler(handler)
    try:
        result = CliRunner().invoke(cli, ["train", *(arg for s in sets for arg in ("--set", s))])
    finally:
        logging.getLogger("mtl").removeHandler(handler)
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    return result.output + handler.stream.getvalue(), steps


def test_finetune_learns_the_task(finetuned):
    said, logged = finetuned
    steps = [s for s in logged if "accuracy" in s]
    assert "fresh head weights: pooler.dense.weight (not in the checkpoint)" in said
    assert "classifier.weight (not in the checkpoint)" in said and "left out (no place in this model): lm_head" in said
    assert len(steps) == 12
    first, last = steps[:3], steps[-3:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < 0.5 * mean(first, "loss"), steps
    assert mean(first, "accuracy") < 0.8 and mean(last, "accuracy") == 1.0, steps
    (validation,) = [s for s in logged if "val_loss" in s]  # the held-out 10% of the lines, at the end
    assert validation["step"] == 12 and validation["val_accuracy"] == 1.0 and validation["val_loss"] < 0.2


def test_tp2_finetunes_like_one_process(pretrained, finetuned):
    """The first 3 steps at tp2 + sequence parallelism: the one-process run's losses, and the
    replicated classifier's gradients equal on both TP ranks."""
    steps = [s for s in finetuned[1] if "accuracy" in s]
    sets = overrides(pretrained, [*FINETUNE, "train.exit_interval=3", "parallel.tp=2", "parallel.sequence_parallel=true"])
    results = run_distributed(run_tiny, 2, args=(sets,))
    losses = next(r["losses"] for r in results if r["last_stage"])
    assert list(losses) == [1, 2, 3]
    for step in losses:
        assert losses[step] == pytest.approx(steps[step - 1]["loss"], rel=LOSS_RTOL)
    grads = assemble(results)  # asserts that ranks holding the same parameter agree
    assert {"classifier.weight", "classifier.bias", "pooler.dense.weight"} <= set(grads)
    assert all(rank["grads"]["classifier.weight"].abs().sum() > 0 for rank in results)


def test_a_changed_encoder_is_refused(pretrained, mtl, clean_error):
    sets = overrides(pretrained, ["model.ffn_hidden_size=48", "train.iters=1", "train.device='cpu'"])
    clean_error(mtl("train", *(arg for s in sets for arg in ("--set", s))),
                       "model.ffn_hidden_size", "different model")
