"""The settings the ``te`` backend refuses when a config is resolved (``Backend.check_config``),
before any work and whether or not Transformer Engine is installed here."""

from __future__ import annotations

from mtl.core.errors import ConfigError


FAST_ACCUMULATION_REFUSED = (
    "train.fp8_fast_accumulation = false is the fp8 backend's setting: Transformer Engine's recipes fix their own "
    "accumulation per GEMM; remove the key or use model.backend = 'fp8'"
)


def check_config(config) -> None:
    """Raise ``ConfigError`` naming the keys for a setting mtl-te cannot run correctly."""
    t = config.train
    if t.fp8 != "none" and not t.fp8_fast_accumulation:
        raise ConfigError(FAST_ACCUMULATION_REFUSED)
    if t.fp8 == "delayed" and t.recompute == "full":
        # Measured on an H100 (packages/te/tests/test_recompute.py): the recomputed forward
        # records its amaxes a second time, so the next micro-batch's scales, and its loss,
        # differ from a run without recompute. TE avoids that only when its FP8 autocast is
        # entered outside the checkpointed region; mtl-te enters it per module.
        raise ConfigError("train.recompute = 'full' with train.fp8 = 'delayed' on model.backend = 'te' would record "
                          "each recomputed forward's amaxes again and train with other scales; use "
                          "train.recompute = 'selective', train.fp8 = 'current', or model.backend = 'fp8' "
                          "(its delayed recipe skips the recompute)")
