"""The model keys only one family reads: any other family refuses them when set (a key that
would do nothing), naming the key and the family that reads it."""

from __future__ import annotations

from mtl.core.errors import ConfigError

# family -> {model key: the value that leaves it off}
FAMILY_KEYS = {
    "bert": {"norm_position": "pre", "type_vocab_size": 0, "position_offset": 0, "binary_head": False,
             "num_labels": 0},
    "t5": {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "scale_decoder_output": False},
    "hybrid": {"hybrid_pattern": None, "mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8,
               "mamba_expand": 2, "mamba_num_heads": None, "mamba_conv_kernel": 4, "mamba_chunk_size": 128,
               "mamba_dt_min": 0.0},
}
T5_ACTIVATIONS = ("relu", "gated-gelu")  # the MLPs of t5 alone


def refuse_other_families_keys(cfg, family: str) -> None:
    m = cfg.model
    for owner, keys in FAMILY_KEYS.items():
        for key, off in keys.items():
            if owner != family and getattr(m, key) != off:
                raise ConfigError(
                    f"model.{key} = {getattr(m, key)!r} is read by model.family = '{owner}' only; model.family = "
                    f"'{m.family}' would ignore it: remove the key (or set model.family = '{owner}')"
                )
    if family != "t5" and m.num_decoder_layers not in (None, m.num_layers):
        raise ConfigError(f"model.num_decoder_layers = {m.num_decoder_layers} is read by model.family = 't5' only; "
                          f"model.family = '{m.family}' has no decoder stack: remove the key")
    if family != "t5" and m.activation in T5_ACTIVATIONS:
        raise ConfigError(f"model.activation = '{m.activation}' is a t5 MLP; model.family = '{m.family}' takes "
                          "'gelu', 'swiglu' or 'relu2'")


def refuse_encoder_keys(cfg) -> None:
    """The ``check_config`` of gpt-like families."""
    refuse_other_families_keys(cfg, "gpt")


def refuse_non_hybrid_keys(cfg) -> None:
    """The ``check_config`` of the hybrid family."""
    refuse_other_families_keys(cfg, "hybrid")
