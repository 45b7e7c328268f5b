"""Config keys that mtl once had and removed: a config that still sets one is refused with one
line naming the key, why it went and what to do, instead of "unknown key". Add a row here when
a key is removed, so users of an older config learn what happened to it."""

from __future__ import annotations

from mtl.core.errors import ConfigError

# "section.key" -> (the mtl-core release that removed it, why, what to do instead)
REMOVED_KEYS: dict[str, tuple[str, str, str]] = {
    "parallel.overlap_layer_comm": (
        "0.2.0",
        "it gave no speed-up on any measured GPU (benchmarks/log: tp=2 + sp 0.903 against "
        "0.757 s at micro-batch 4, 0.615 against 0.614 s at micro-batch 8, on 2 H200s)",
        "delete the key",
    ),
    "train.compile_cpp_wrapper": (
        "0.2.0",
        "it helped only a tensor-parallel rank bound by its host, which micro-batches of 8 also cure "
        "(benchmarks/log: tp=2 + sp on 2 H200s 0.612 against 0.614 s there), and torch 2.13's "
        "C++ wrapper cannot call a tensor-parallel layer's collectives",
        "delete the key",
    ),
}


def refuse_removed_key(dotted: str, source: str) -> None:
    """Raise ``ConfigError`` when ``dotted`` ("section.key") is a removed key."""
    if dotted in REMOVED_KEYS:
        release, why, fix = REMOVED_KEYS[dotted]
        raise ConfigError(f"{source}: {dotted} was removed in mtl-core {release}: {why}; {fix}")
