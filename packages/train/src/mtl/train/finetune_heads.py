"""A fine-tuning start (``ckpt.finetune_from``) into a model with a new head.

A model names the weights a fine-tuning start may leave at their fresh initialisation through
``finetune_heads`` (global-name prefixes: bert with ``model.num_labels`` names its pooler and
classifier). Those the checkpoint lacks (a masked-LM checkpoint has no classifier) or holds in
another shape (a classifier over another number of labels) are taken out of the load and keep
their initialisation; every other weight loads as usual, and a missing one or another shape
there is still refused by the load, naming the tensor. One log line says which head weights
start afresh and which of the checkpoint's weights this model has no place for (its MLM head).
"""

from __future__ import annotations

from mtl.ckpt.directory import read_manifest
from mtl.core.log import get_logger
from mtl.train.ranks import is_first_rank

log = get_logger(__name__)
PREFIX = "model."


def _head_prefixes(chunks: list) -> tuple[str, ...]:
    prefixes: set[str] = set()
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        prefixes.update(getattr(model, "finetune_heads", ()))
    return tuple(sorted(prefixes))


def _global_shape(target) -> tuple[int, ...]:
    """A template entry's global shape: one ShardedTensor, or (16-bit weights with fp32 main
    copies: the optimizer's load template) a list of the boxes of one tensor."""
    return tuple((target[0] if isinstance(target, list) else target).global_shape)


def leave_fresh_heads(template: dict, chunks: list, directory: str, iteration: int) -> None:
    """Take out of ``template`` (checkpoint key -> ShardedTensor) the head weights ``directory``
    cannot fill, so they keep their fresh initialisation, and say so in one line (rank 0)."""
    prefixes = _head_prefixes(chunks)
    if not prefixes:  # a model without a replaceable head: the load takes every weight, as a resume does
        return
    stored = read_manifest(directory, iteration)["tensors"]
    fresh = []
    for key, target in list(template.items()):
        name = key.removeprefix(PREFIX)
        if not key.startswith(PREFIX) or not name.startswith(prefixes):
            continue
        if key not in stored:
            fresh.append(f"{name} (not in the checkpoint)")
        elif tuple(stored[key]["global_shape"]) != _global_shape(target):
            fresh.append(f"{name} (stored {tuple(stored[key]['global_shape'])}, here {_global_shape(target)})")
        else:
            continue
        del template[key]
    unused = sorted(k.removeprefix(PREFIX) for k in stored if k.startswith(PREFIX) and k not in template
                    and not k.removeprefix(PREFIX).startswith(prefixes))
    if is_first_rank() and (fresh or unused):
        log.info("ckpt.finetune_from = %s: the encoder loads; %s%s", directory,
                 f"fresh head weights: {', '.join(dict.fromkeys(fresh))}" if fresh else "the head loads too",
                 f"; left out (no place in this model): {', '.join(unused)}" if unused else "")

