"""``mtl train --dry-run`` refuses optimizer and checkpoint-schedule settings that training
would refuse (or crash on), naming the key and the accepted range."""

import pytest


@pytest.mark.parametrize("override, needles", [
    ("train.adam_beta1=1.5", ("train.adam_beta1 = 1.5", "[0, 1)")),
    ("train.adam_eps=0", ("train.adam_eps = 0.0", "positive")),
    ("train.min_lr=1.0", ("train.min_lr = 1.0", "train.lr = 0.001")),
    ("train.weight_decay=-0.1", ("train.weight_decay = -0.1",)),
    ("ckpt.interval_minutes=-5", ("ckpt.interval_minutes = -5.0",)),
])
def test_dry_run_checks_the_optimizer_settings(mtl, clean_error, tiny_toml, workdir, override, needles):
    clean_error(mtl("train", tiny_toml, "--dry-run", "--set", override), *needles)
    clean_error(mtl("train", tiny_toml, "--set", override), *needles)  # and a real run, before any work
    assert not (workdir / "ckpt").exists()
