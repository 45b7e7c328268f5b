"""Which model family each dataset's samples feed, checked before any sample is built.

GPT samples (``tokens``/``labels``) feed the decoder-only families; the bert and t5 datasets'
samples (Megatron's field names) feed only the family of their name. A mismatch would fail on
the first batch, deep in the model: it is one line here instead.
"""

from __future__ import annotations

from mtl.core.errors import ConfigError

# the families whose samples only their own dataset makes
MASKED_FAMILIES = ("bert", "t5")


def check_family(config, dataset: str) -> None:
    family = config.model.family
    expected = family if family in MASKED_FAMILIES else "gpt"
    if dataset != expected and (dataset in MASKED_FAMILIES or family in MASKED_FAMILIES):
        raise ConfigError(f"data.dataset = '{dataset}' makes {dataset} samples but model.family = "
                          f"'{family}' trains on {expected} samples; set data.dataset = '{expected}'")
