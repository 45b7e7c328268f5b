"""The ``t5`` family trains through ``mtl.train.loop.train`` (what ``mtl train`` runs) like one
process at tp2, tp2 with sequence parallelism, dp2, pp2 (encoder | decoder), pp4 (2 + 2 stages)
and tp2 (sequence-parallel) x pp2, with selective and full recompute: the first 3 losses within 1e-5 relative and
every gradient within the gpt layout tests' tolerances; the pp2 run's checkpoint resumes at tp2
like a straight run. T5 1.1-shaped (gated GELU, untied head) on mtl-data's ``t5``
dataset (Megatron's span corruption with sentinels) over a sentence-split corpus, with a
WordPiece vocabulary of T5's real size (32128 rows)."""

import json

import pytest

from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess
from mtl.train.testing import LOSS_RTOL, compare_with_reference, run_grouped, run_tiny, write_sized_wordpiece

T5_VOCAB = 32128
ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
         "mask_token": "[MASK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}
SENTINELS = tuple(f"<extra_id_{i}>" for i in range(40))
T5 = [
    "model.family='t5'", "model.activation='gated-gelu'", "model.tie_embeddings=false", "model.normalization='rmsnorm'",
    "model.norm_eps=1e-6", "model.bias=false", "model.num_query_groups=4", "model.ffn_hidden_size=48",
    "model.num_layers=2", "model.num_decoder_layers=2", "model.seq_length=32", "data.decoder_seq_length=16",
    "model.relative_attention_num_buckets=8", "model.relative_attention_max_distance=20",
    "data.dataset='t5'", "data.tokenizer='hf'", "data.split='90,5,5'",
]
# Issue 35's layouts; recompute changes no number, so each kind rides on a layout of its own.
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    # both stacks sequence-sharded; cross-attention gathers the sharded encoder output
    "tp2_sp_selective_recompute": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                       "train.recompute='selective'"]),
    "dp2_full_recompute": (2, ["train.recompute='full'"]),
    "pp2": (2, ["parallel.pp=2"]),  # encoder | decoder
    "pp4": (4, ["parallel.pp=4"]),  # 2 encoder stages, then 2 decoder stages
    # with sequence parallelism: the stages exchange sequence shards of both stacks' states
    "tp2_sp_pp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]),
}
# T5 1.0's head (tied to the embedding, the decoder output rescaled first) split over stages: the
# first stage's embedding and the last stage's copy sum their gradients; compared with its own run.
T5_1_0 = ["model.activation='relu'", "model.tie_embeddings=true", "model.scale_decoder_output=true"]
TIED_LAYOUTS = {"pp2_tied_head": (2, ["parallel.pp=2", *T5_1_0])}
# Every run follows the same 6-step schedule; the layouts stop after 3 (a run's first half).
FIRST_HALF = ["train.iters=6", "train.exit_interval=3"]
SAVED_AT, RESUMED_AT = "pp2", "tp2"  # the checkpoint's layout, and the one that resumes it


def t5_run(overrides, corpus):
    prefix, tokenizer = corpus
    with_grads = "train.exit_interval=3" in overrides  # the resume runs need losses only
    return run_tiny([*T5, f"data.tokenizer_model='{tokenizer}'", f"data.paths=['{prefix}']", *overrides], with_grads)


def t5_runs(runs, corpus):
    """Each run of ``runs`` (a list of overrides) in turn, in one spawned world."""
    return [t5_run(overrides, corpus) for overrides in runs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5_corpus")
    jsonl = write_demo_corpus(str(root / "corpus.jsonl"), num_docs=200, seed=4)
    texts = [json.loads(line)["text"] for line in open(jsonl, encoding="utf-8")]
    tokenizer = str(write_sized_wordpiece(root, texts, T5_VOCAB, ROLES, SENTINELS))
    preprocess(jsonl, str(root / "corpus"), "hf", tokenizer, progress=False, split_sentences=True)
    return str(root / "corpus"), tokenizer


@pytest.fixture(scope="module")
def results(corpus, tmp_path_factory):
    """Every run by name, those of one world size from one spawn. The 2-process world also saves
    the pp2 run's step-3 checkpoint and then resumes it at tp2 for steps 4-6."""
    checkpoint = tmp_path_factory.mktemp("t5_ckpt") / "ckpt"
    runs = {"reference": (1, FIRST_HALF), "straight": (1, ["train.iters=6"]),
            "reference_tied": (1, [*FIRST_HALF, *T5_1_0])}
    for name, (world, overrides) in {**LAYOUTS, **TIED_LAYOUTS}.items():
        save = [f"ckpt.save='{checkpoint}'"] if name == SAVED_AT else []
        runs[name] = (world, [*FIRST_HALF, *overrides, *save])
    runs["resumed"] = (LAYOUTS[RESUMED_AT][0], ["train.iters=6", *LAYOUTS[RESUMED_AT][1], f"ckpt.save='{checkpoint}'"])
    return run_grouped(runs, t5_runs, args=(corpus,))


@pytest.mark.parametrize("layout", [*LAYOUTS, *TIED_LAYOUTS])
def test_t5_layout_matches_single_process(layout, results):
    (reference,) = results["reference_tied" if layout in TIED_LAYOUTS else "reference"]
    assert len(reference["losses"]) == 3
    compare_with_reference(layout, results[layout], reference)


def test_t5_saved_at_pp2_resumes_at_tp2(results):
    """Steps 4-6 resumed at tp2 from the pp2 run's step-3 checkpoint equal a straight 6-step run."""
    (straight,) = results["straight"]
    losses = next(r["losses"] for r in results["resumed"] if r["last_stage"])
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(losses[step] - straight["losses"][step]) <= LOSS_RTOL * abs(straight["losses"][step])
