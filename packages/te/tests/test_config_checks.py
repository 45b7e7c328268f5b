"""Settings the ``te`` backend refuses at ``RunConfig.resolve``, before any work, installed or not
(``mtl.te.config_checks``, the backend's ``check_config``)."""

import pytest

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError


def _resolve(**train) -> None:
    config = RunConfig()
    config.model.backend = "te"
    for key, value in train.items():
        setattr(config.train, key, value)
    config.resolve(1, 100)


def test_full_recompute_with_delayed_scaling_is_refused_naming_the_keys():
    with pytest.raises(ConfigError) as caught:
        _resolve(fp8="delayed", recompute="full")
    message = str(caught.value)
    assert "train.recompute = 'full'" in message and "train.fp8 = 'delayed'" in message
    assert "train.recompute = 'selective'" in message and "model.backend = 'fp8'" in message


def test_fast_accumulation_off_is_refused_at_resolve():
    with pytest.raises(ConfigError, match="train.fp8_fast_accumulation = false"):
        _resolve(fp8="current", fp8_fast_accumulation=False)


@pytest.mark.parametrize("train", [{"fp8": "delayed", "recompute": "selective"}, {"fp8": "current", "recompute": "full"},
                                   {"recompute": "full"}])
def test_what_it_runs_correctly_passes_the_check(train):
    from mtl.core.plugins import registry

    config = RunConfig()
    for key, value in train.items():
        setattr(config.train, key, value)
    registry("backend").get("te").check_config(config)  # no error; resolve may still ask for TE itself
