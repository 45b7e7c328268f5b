"""The settings the ``bert`` family refuses, before any work (``ModelFamily.check_config``)."""

from __future__ import annotations

from mtl.core.errors import ConfigError
from mtl.models.family_keys import refuse_other_families_keys


def _refuse(refused: list[tuple[bool, str, str]]) -> None:
    for bad, setting, fix in refused:
        if bad:
            raise ConfigError(f"model.family = 'bert' cannot run with {setting}: set it to {fix}")


def check_encoder_config(cfg) -> None:
    m, t = cfg.model, cfg.train
    refuse_other_families_keys(cfg, "bert")
    _refuse([
        (not m.tie_embeddings, "model.tie_embeddings = false", "true (the MLM decoder reads the word embedding)"),
        (m.position_embedding != "learned", f"model.position_embedding = '{m.position_embedding}'",
         "'learned' (BERT's absolute positions)"),
        (m.num_experts > 0, f"model.num_experts = {m.num_experts}", "0 (the bert family's MLPs are dense)"),
        (t.cuda_graphs, "train.cuda_graphs = true", "false (the encoder does not capture its layers)"),
    ])
    if m.num_labels:
        check_classification_config(cfg)


def check_classification_config(cfg) -> None:
    """``model.num_labels != 0``: sequence classification, and the settings it cannot take."""
    m, p = cfg.model, cfg.parallel
    _refuse([
        (m.num_labels < 0, f"model.num_labels = {m.num_labels}", "0 (pre-training heads) or the number of classes"),
        # HF's num_labels = 1 is MSE regression on float labels; the classification dataset reads integer classes
        (m.num_labels == 1, "model.num_labels = 1 (regression)", "2 or more classes (regression is not supported)"),
        (m.binary_head, "model.binary_head = true and model.num_labels > 0",
         "false (the classifier replaces the pre-training heads)"),
        # the classifier reads [CLS], which the last stage and the first cp chunk hold: one stage, one chunk
        (p.pp > 1, f"parallel.pp = {p.pp} and model.num_labels > 0", "1 (classification fine-tuning runs unpipelined)"),
        (p.cp > 1, f"parallel.cp = {p.cp} and model.num_labels > 0", "1 (the [CLS] token sits on cp rank 0 alone)"),
    ])
