"""The settings the ``bert`` family refuses, before any work (``ModelFamily.check_config``)."""

from __future__ import annotations

from mtl.core.errors import ConfigError


def check_encoder_config(cfg) -> None:
    m, t = cfg.model, cfg.train
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


# the model keys only an encoder reads, and the value that leaves them off
ENCODER_KEYS = {"norm_position": "pre", "type_vocab_size": 0, "position_offset": 0, "binary_head": False}


def refuse_encoder_keys(cfg) -> None:
    """For a decoder family: an encoder key set would do nothing, so it is refused."""
    for key, off in ENCODER_KEYS.items():
        value = getattr(cfg.model, key)
        if value != off:
            raise ConfigError(
                f"model.{key} = {value!r} is read by model.family = 'bert' only; model.family = "
                f"'{cfg.model.family}' would ignore it: remove the key (or set model.family = 'bert')"
            )
