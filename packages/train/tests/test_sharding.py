"""Sharded data parallelism (``parallel.sharding``, ``dp_replicate``) trains like one process:
fp32 on CPU with gloo, the first 3 losses within 1e-5 relative and the gradients, gathered to
their full shape from the ranks' shards, within ``mtl.train.testing``'s tolerances.

- dp=2, ZeRO-3 (parameters gathered per unit, freed, gathered again for backward); its
  checkpoint resumes under ZeRO-2 (gradients reduce-scattered per bucket, shards kept) for
  steps 4-6, whose losses and step-6 gradients equal a straight 6-step run of one process.
- ep=2 with a mixture of experts under ZeRO-3 (experts sharded over their replicas).
- dp=2, ZeRO-3 with an untied output layer (the embedding and the head gathered as units of their
  own, each around its forward and backward; the default tied run shares one table between them).
- The memory that buys, on a model whose vocabulary dominates (a WordPiece tokenizer of BERT's
  30522 words, hidden 32, 2 layers, untied): the buffers' peak (``held_bytes``) is 1.5 vocabulary
  tables lower than when the tables are gathered for the whole step (the grouping of a model
  without ``gather_units``), and the fused LM head + loss stays on.

The 4-process layouts of ``SHARDED_LAYOUTS`` (dp4, tp2 x dp2, dp2 x pp2 under ZeRO-3, and dp=4
as 2 replicas x 2 shards) are checked in mtl-cli's ``test_sharding_dp4.py``, in the 4-process
spawn that measures memory. One spawn per world size: the single process runs the references,
two processes run the rest.
"""

import json

import pytest

from mtl.core.config_io import load_config
from mtl.data.demo_corpus import write_demo_corpus
from mtl.models.gpt.model import GPTModel
from mtl.parallel.tensor_parallel.linear_cross_entropy import supports_fused_cross_entropy
from mtl.parallel.testing import run_distributed
from mtl.train.loop import train
from mtl.train.testing import MOE_TINY, TINY, compare_with_reference, run_tiny, write_sized_wordpiece

SCHEDULE = ["train.lr_decay_iters=6"]  # a 3-step run is the first half of the 6-step one
UNTIED = [*SCHEDULE, "model.tie_embeddings=false"]
BERT_VOCAB = 30522  # bert-base-uncased's vocabulary: 30592 padded rows, 98% of the model at hidden 32
ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}


def single_process_runs() -> dict:
    return {"reference": run_tiny(SCHEDULE), "straight": run_tiny([*SCHEDULE, "train.iters=6"]),
            "moe": run_tiny(MOE_TINY), "untied": run_tiny(UNTIED)}


def two_process_runs(save_dir: str, tokenizer: str) -> dict:
    return {
        "zero3": run_tiny([*SCHEDULE, "parallel.sharding='parameters'", f"ckpt.save='{save_dir}'"]),
        "zero2_resumed": run_tiny([*SCHEDULE, "parallel.sharding='gradients'", "train.iters=6",
                                   f"ckpt.load='{save_dir}'"]),
        "moe_ep2_zero3": run_tiny([*MOE_TINY, "parallel.ep=2", "parallel.sharding='parameters'"]),
        "zero3_untied": run_tiny([*UNTIED, "parallel.sharding='parameters'"]),
        "vocabulary_peaks": vocabulary_peaks(tokenizer),
        "tied_gathers": tied_gathers(),
    }


def tied_gathers() -> dict:
    """One ZeRO-3 step (2 micro-batches) of the tied model: the all-gathers launched, and the
    buckets its units hold (the head's: the embedding's table)."""
    (chunk,) = train(load_config(None, [*TINY, "model.num_layers=2", "train.iters=1",
                                        "parallel.sharding='parameters'"]), progress=False).run.chunks
    gather = chunk.layer_gather
    out = {"gathers": gather.num_gathers, "unit_buckets": sum(len(b) for b in gather.buckets_of.values()),
           "borrowing": sorted(gather.borrowing_units), "units": len(chunk.module.gather_units())}
    table = chunk.module.embedding.word_embeddings.weight
    with chunk.whole_parameters(write_back=True):  # what a checkpoint's load does
        table.data.fill_(1.5)
    with chunk.whole_parameters():
        out["loaded"] = bool((table == 1.5).all()) and chunk.module.output_layer.weight is table
    return out


def vocabulary_peaks(tokenizer: str) -> dict:
    """One ZeRO-3 step (2 micro-batches) of the large-vocabulary model, with GPT's gather units
    and with those of a model that has only ``compile_units`` (the tables gathered for the whole
    step): the buffers' peak bytes of each, one table's bytes and one layer's."""
    overrides = [*TINY, "model.num_layers=2", "model.tie_embeddings=false", "train.iters=1", "data.tokenizer='hf'",
                 f"data.tokenizer_model='{tokenizer}'", "parallel.sharding='parameters'"]
    out = {}
    for grouping in ("gpt_units", "layers_only"):
        own_units = GPTModel.gather_units
        if grouping == "layers_only":
            GPTModel.gather_units = GPTModel.compile_units
        try:
            (chunk,) = train(load_config(None, overrides), progress=False).run.chunks
        finally:
            GPTModel.gather_units = own_units
        out[grouping] = chunk.held_bytes.peak
        out[f"fused_{grouping}"] = supports_fused_cross_entropy(chunk.module.output_layer)
    model = chunk.module
    out["table"] = model.embedding.word_embeddings.weight.numel() * 4  # fp32
    out["layer"] = sum(p.numel() for p in model.compile_units()[0].parameters()) * 4
    return out


@pytest.fixture(scope="module")
def single():
    (result,) = run_distributed(single_process_runs, 1)
    return result


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3")
    corpus = write_demo_corpus(str(root / "corpus.jsonl"), num_docs=50, seed=3)
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    tokenizer = str(write_sized_wordpiece(root, texts, BERT_VOCAB, ROLES))
    return run_distributed(two_process_runs, 2, args=(str(root / "ckpt"), tokenizer))


def test_dp2_zero3_matches_single_process(two, single):
    compare_with_reference("dp2 zero3", [r["zero3"] for r in two], single["reference"])


def test_zero3_checkpoint_resumes_under_zero2_like_a_straight_run(two, single):
    resumed = [r["zero2_resumed"] for r in two]
    assert sorted(resumed[0]["losses"]) == [4, 5, 6]
    straight = {**single["straight"], "losses": {s: single["straight"]["losses"][s] for s in (4, 5, 6)}}
    compare_with_reference("zero3 -> zero2 resume", resumed, straight)


def test_ep2_moe_zero3_matches_single_process(two, single):
    compare_with_reference("ep2 moe zero3", [r["moe_ep2_zero3"] for r in two], single["moe"])


def test_dp2_zero3_with_an_untied_head_matches_single_process(two, single):
    compare_with_reference("dp2 zero3 untied", [r["zero3_untied"] for r in two], single["untied"])


def test_zero3_holds_one_and_a_half_vocabulary_tables_less_with_the_tables_as_units(two):
    """At the head's backward. Tables gathered for the whole step: both tables, the head's full
    gradient and its reduce-scatter's output (half a table at dp 2). As units: the head's
    weights are freed once its gradient arrived, before that output is allocated, so the most
    is a table's weights and gradient, or its gradient and the output: 2 tables, not 3.5. Give
    or take what else is whole at the two peaks: a layer's prefetch, a norm's bucket of 2 x 16
    aligned elements."""
    for rank in two:
        peaks = rank["vocabulary_peaks"]
        slack = peaks["layer"] + 2 * 16 * 4
        assert abs(peaks["layers_only"] - peaks["gpt_units"] - 1.5 * peaks["table"]) <= slack, peaks
        assert peaks["fused_gpt_units"] and peaks["fused_layers_only"], peaks  # no fallback to whole logits


def test_zero3_peak_is_the_shards_and_one_table_with_its_gradient(two):
    """Every parameter's weight and gradient shard (2 tables + 2 layers at dp 2) and 2 tables
    (above): 4 tables and some layers (the shards', the prefetched ones'). The embedding's
    gradient of the first micro-batch, the last bucket it reduce-scatters, is done when the
    second forward starts, not still held at the second head's backward (which would be 1.5
    tables more)."""
    for rank in two:
        peaks = rank["vocabulary_peaks"]
        assert 4 * peaks["table"] <= peaks["gpt_units"] <= 4 * peaks["table"] + 4 * peaks["layer"], peaks


def test_tied_head_gathers_the_embedding_table_for_its_own_forward_and_backward(two):
    """Every unit's buckets gathered for its forward and again for its backward, per micro-batch,
    but the head's (the last unit: kept whole from its forward into its backward, which comes
    next): the tied table 3 times, so the head freed it after its backward (else the embedding's
    backward would find it still whole, and 2 gathers would be missing)."""
    for rank in two:
        tied = rank["tied_gathers"]
        assert tied["borrowing"] == [tied["units"] - 1], tied  # the output layer, the last unit
        assert tied["gathers"] == 2 * (2 * tied["unit_buckets"] - 1), tied
        assert tied["loaded"], tied  # a load into the tied table reaches this rank's shard
