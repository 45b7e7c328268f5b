"""The settings the ``bert`` family refuses, before any work (``ModelFamily.check_config``)."""

from __future__ import annotations

from mtl.core.errors import ConfigError
from mtl.models.family_keys import refuse_other_families_keys


def check_encoder_config(cfg) -> None:
    m, t = cfg.model, cfg.train
    refuse_other_families_keys(cfg, "bert")
    refused = [
        (not m.tie_embeddings, "model.tie_embeddings = false", "true (the MLM decoder reads the word embedding)"),
        (m.position_embedding != "learned", f"model.position_embedding = '{m.position_embedding}'",
         "'learned' (BERT's absolute positions)"),
        (m.num_experts > 0, f"model.num_experts = {m.num_experts}", "0 (the bert family's MLPs are dense)"),
        (t.cuda_graphs, "train.cuda_graphs = true", "false (the encoder does not capture its layers)"),
    ]
    for bad, setting, fix in refused:
        if bad:
            raise ConfigError(f"model.family = 'bert' cannot run with {setting}: set it to {fix}")
