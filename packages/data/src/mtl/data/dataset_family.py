"""Which model family each dataset's samples feed, checked before any sample is built.

GPT samples (``tokens``/``labels``) feed the decoder-only families; the bert and t5 datasets'
samples (Megatron's field names) feed only the family of their name, and the classification
dataset's only bert with ``model.num_labels``. A mismatch would fail on
the first batch, deep in the model: it is one line here instead.
"""

from __future__ import annotations

from mtl.core.errors import ConfigError

# the families whose samples only their own dataset makes
MASKED_FAMILIES = ("bert", "t5")
# the datasets whose samples feed one family only
OWN_FAMILY_DATASETS = ("bert", "t5", "classification")


def expected_dataset(config) -> str:
    """The dataset whose samples ``config``'s model trains on: bert with ``model.num_labels``
    classifies sequences."""
    family = config.model.family
    if family == "bert" and getattr(config.model, "num_labels", 0):
        return "classification"
    return family if family in MASKED_FAMILIES else "gpt"


def check_family(config, dataset: str) -> None:
    family = config.model.family
    expected = expected_dataset(config)
    if dataset == "classification" and family == "bert" and expected != dataset:
        raise ConfigError("data.dataset = 'classification' trains a sequence classifier: set model.num_labels "
                          "to the number of classes (or data.dataset = 'bert' for pre-training)")
    if dataset != expected and (dataset in OWN_FAMILY_DATASETS or family in MASKED_FAMILIES):
        raise ConfigError(f"data.dataset = '{dataset}' makes {dataset} samples but model.family = "
                          f"'{family}' trains on {expected} samples; set data.dataset = '{expected}'")
