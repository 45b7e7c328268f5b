"""``mtl train`` with ``model.family = 't5'``: what it does not run yet, and t5's keys on
another family, are one line before any work."""

import pytest

T5 = ["model.family='t5'", "model.activation='gated-gelu'", "model.normalization='rmsnorm'", "model.bias=false",
      "data.dataset='t5'"]


@pytest.mark.parametrize("overrides, needles", [
    (T5 + ["parallel.pp=2"], ["parallel.pp = 2", "t5"]),
    (T5 + ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.sequence_parallel", "t5"]),
    (T5 + ["model.activation='swiglu'"], ["model.activation = 'swiglu'", "'gated-gelu'"]),
    (["model.activation='relu'"], ["model.activation = 'relu'", "t5"]),  # a t5 MLP on gpt
    (["model.relative_attention_num_buckets=16"], ["model.relative_attention_num_buckets", "'t5'"]),
])
def test_t5_settings_it_cannot_run_are_one_line(mtl, clean_error, tiny_toml, overrides, needles):
    args = [a for o in overrides for a in ("--set", o)]
    clean_error(mtl("train", tiny_toml, *args, "--dry-run"), *needles)
