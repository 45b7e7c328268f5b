"""``mtl train`` with ``model.family = 't5'``: what it does not run yet, and t5's keys on
another family, are one line before any work."""

import pytest

T5 = ["model.family='t5'", "model.activation='gated-gelu'", "model.normalization='rmsnorm'", "model.bias=false",
      "data.dataset='t5'"]


@pytest.mark.parametrize("overrides, needles", [
    (T5 + ["parallel.pp=2", "parallel.vpp=2"], ["parallel.vpp = 2", "t5"]),
    (T5 + ["parallel.cp=2"], ["parallel.cp = 2", "t5"]),
    (T5 + ["parallel.tp=2", "parallel.sequence_parallel=true", "data.decoder_seq_length=15"],
     ["data.decoder_seq_length = 15", "parallel.tp = 2"]),
    (T5 + ["model.activation='swiglu'"], ["model.activation = 'swiglu'", "'gated-gelu'"]),
    (["model.activation='relu'"], ["model.activation = 'relu'", "t5"]),  # a t5 MLP on gpt
    (["model.relative_attention_num_buckets=16"], ["model.relative_attention_num_buckets", "'t5'"]),
])
def test_t5_settings_it_cannot_run_are_one_line(mtl, clean_error, tiny_toml, overrides, needles):
    args = [a for o in overrides for a in ("--set", o)]
    clean_error(mtl("train", tiny_toml, *args, "--dry-run"), *needles)


def test_dry_run_shows_the_encoder_decoder_and_its_flops(mtl, ok, tiny_toml):
    from mtl.core.config_io import load_config
    from mtl.models.t5.flops import flops_per_iteration

    out = ok(mtl("train", tiny_toml, *[a for o in T5 for a in ("--set", o)], "--dry-run"))
    assert "model (T5Model)" in out and "2 x T5Layer" in out and "relative_position_bias" in out
    cfg = load_config(tiny_toml, T5).resolve(1, 257)
    assert f"FLOPs per iteration: {flops_per_iteration(cfg):.4e}" in out
