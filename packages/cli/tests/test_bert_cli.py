"""``mtl train`` with ``model.family = 'bert'``: ``--dry-run`` shows the encoder and its FLOPs,
and bad settings are one line before any work."""

import pytest

from mtl.core.config_io import load_config
from mtl.models.bert.flops import flops_per_iteration

BERT_KEYS = ["model.family='bert'", "model.norm_position='post'", "model.type_vocab_size=2", "data.dataset='bert'"]
BERT = [a for key in BERT_KEYS for a in ("--set", key)]


def test_dry_run_shows_the_encoder(mtl, ok, tiny_toml):
    out = ok(mtl("train", tiny_toml, *BERT, "--dry-run"))
    assert "model (EncoderModel)" in out and "2 x EncoderLayer" in out
    assert "token_type_embeddings (Embedding): 64" in out and "lm_head (MaskedLMTransform)" in out
    cfg = load_config(tiny_toml, BERT_KEYS)
    assert f"FLOPs per iteration: {flops_per_iteration(cfg.resolve(1, 257)):.4e}" in out


@pytest.mark.parametrize("overrides, needles", [
    (["model.binary_head=true"], ["model.binary_head", "model.family = 'gpt'"]),  # gpt ignores it: refused
    (BERT_KEYS + ["model.tie_embeddings=false"], ["model.tie_embeddings", "bert"]),
    (BERT_KEYS + ["parallel.pp=4"], ["model.num_layers = 2", "pp*vpp"]),  # more stages than layers
    (["model.family='bert'"], ["lack text", "data.dataset = 'bert'"]),  # mock (gpt) samples for an encoder
    # another family's keys are refused, not ignored: the SSM's on gpt, bert's on the hybrid family,
    # and what T5 has no place for
    (["model.mamba_state_dim=64"], ["model.mamba_state_dim", "model.family = 'hybrid'"]),
    (["model.family='hybrid'", "model.hybrid_pattern='M*'", "model.mamba_head_dim=8", "model.mamba_num_groups=1",
      "model.binary_head=true"], ["model.binary_head"]),
    # sequence classification: what it refuses, and the dataset it needs
    (["model.num_labels=2"], ["model.num_labels", "model.family = 'bert'"]),
    (BERT_KEYS + ["model.num_labels=1"], ["model.num_labels = 1 (regression)", "2 or more classes"]),
    (BERT_KEYS + ["model.num_labels=2", "model.binary_head=true"], ["model.binary_head = true", "false"]),
    (BERT_KEYS + ["model.num_labels=2", "parallel.pp=2"], ["parallel.pp = 2", "unpipelined"]),
    (BERT_KEYS + ["model.num_labels=2"], ["data.dataset = 'bert'", "set data.dataset = 'classification'"]),
    (["model.family='t5'", "model.activation='relu'", "model.normalization='rmsnorm'", "model.bias=false",
      "model.qkv_bias=true", "data.dataset='t5'"],
     ["model.qkv_bias = true", "T5 has no biases"]),
])
def test_bad_settings_are_one_line(mtl, clean_error, tiny_toml, overrides, needles):
    args = [a for o in overrides for a in ("--set", o)]
    dry_run = ["--dry-run"] if {"parallel.pp=4", "parallel.pp=2"} & set(overrides) else []  # a dry run takes the world the layout needs
    clean_error(mtl("train", tiny_toml, *args, *dry_run), *needles)
