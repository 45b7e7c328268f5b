"""Family-independent size and memory arithmetic. A family's own formulas (FLOPs per
iteration, activations per layer) come with its ``ModelFamily`` record; core holds none."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mtl.core.config import RunConfig, pipeline_num_layers, pipeline_rank_layers
from mtl.core.model_protocol import gather_units_of


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters per top-level component of ``model`` (its direct children, in order) and
    their ``total``. Each parameter is counted once, under the first component holding it, so
    a tied output layer shows 0; every stored element counts, padded vocabulary rows included
    (the same number as ``sum(p.numel() for p in model.parameters())``)."""
    counts: dict[str, int] = {}
    seen: set[int] = set()

    def take(params) -> int:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    for name, child in model.named_children():
        counts[name] = take(child.parameters())
    own = take(model.parameters(recurse=False))
    if own:
        counts["(model)"] = own
    counts["total"] = sum(counts.values())
    return counts


def gather_unit_sizes(model: nn.Module) -> tuple[int, int, int]:
    """(parameters of the largest layer, of the largest other gather unit, outside every unit)
    of ``model``: what ``parallel.sharding = "parameters"`` gathers whole besides the shards.
    Its units are ``gather_units_of(model)``; the layers among them are the ``compile_units()``,
    the others GPT's embedding and output layer (``mtl.core.model_protocol``)."""
    units = gather_units_of(model)
    compile_units = getattr(model, "compile_units", None)
    layer_ids = {id(unit) for unit in compile_units()} if callable(compile_units) else set()

    def size(unit: nn.Module) -> int:
        return sum(p.numel() for p in unit.parameters())

    in_units = {id(p) for unit in units for p in unit.parameters()}
    largest_layer = max((size(u) for u in units if id(u) in layer_ids), default=0)
    largest_other = max((size(u) for u in units if id(u) not in layer_ids), default=0)
    return largest_layer, largest_other, sum(p.numel() for p in model.parameters() if id(p) not in in_units)


def memory_per_gpu_bytes(cfg: RunConfig, num_parameters: int,
                         activation_bytes_per_layer: float | Sequence[float] | None,
                         num_expert_parameters: int = 0, unit_parameters: tuple[int, int, int] | None = None,
                         ) -> dict[str, float]:
    """An estimate per GPU of ``num_parameters`` (the whole model's) split over tp x pp, of which
    the ``num_expert_parameters`` (``param.expert_split_dim``) are also split over ep:

    - weights: the model's (16-bit, or fp32 under ``train.params_dtype = "fp32"``);
    - grads: fp32, accumulated and reduced;
    - optimizer: AdamW's two fp32 moments and, under 16-bit weights, the fp32 main weights.

    ``parallel.sharding`` divides them over the ranks a shard spans, dp x cp / dp_replicate
    (experts: their dp / ep x cp): "optimizer" the optimizer state, "gradients" also the grads,
    "parameters" also the weights. What is then held whole besides the shards is added: under
    "gradients" and "parameters" two gradient buckets (one filling, one reduce-scattering; a
    bucket is a layer or ``parallel.bucket_size_mb``, whichever is smaller, but a vocabulary
    table's is the whole table, one parameter) and the gradients outside every unit, and under
    "parameters" two units' weights (the one running, the largest, and the next one's gather,
    a layer) and the weights outside every unit, gathered for the whole step;
    ``unit_parameters`` = (largest layer, largest other unit, outside every unit) of the whole
    model, from ``gather_unit_sizes``, split by tp only (a unit is whole on its stage). Activations: one micro-batch per in-flight pipeline stage on
    the rank that keeps the most (``activation_bytes_per_layer`` from the family, one number for
    every layer or one per layer in layer order; left out when it has none)."""
    p, t = cfg.parallel, cfg.train
    split = p.tp * p.pp
    dense = (num_parameters - num_expert_parameters) / split
    experts = num_expert_parameters / (split * p.ep)
    dense_shards = p.dp * p.cp // p.dp_replicate
    expert_shards = p.dp // p.ep * p.cp // p.dp_replicate
    level = ("none", "optimizer", "gradients", "parameters").index(p.sharding)

    def per_rank(bytes_per_parameter: float, from_level: int) -> float:
        if level < from_level:
            return (dense + experts) * bytes_per_parameter
        return (dense / dense_shards + experts / expert_shards) * bytes_per_parameter

    weight_bytes = 4 if t.params_dtype == "fp32" else 2
    main_bytes = 0 if weight_bytes == 4 else 4  # the fp32 main copy of 16-bit weights
    out = {"weights": per_rank(weight_bytes, 3), "grads": per_rank(4, 2), "optimizer": per_rank(8 + main_bytes, 1)}
    if level >= 2 and unit_parameters is not None:
        # a unit sits whole on one pipeline stage: only tp splits it (the largest table or layer
        # is gathered whole on the stage that holds it)
        layer, table, outside = (n / p.tp for n in unit_parameters)
        # a bucket ends at a layer's end or at parallel.bucket_size_mb (of the weights' dtype), whichever first
        bucket = min(layer, p.bucket_size_mb * 2**20 / weight_bytes)
        out["grads"] += (max(bucket, table) + bucket + outside) * 4
        if level == 3:
            out["weights"] += (max(layer, table) + layer + outside) * weight_bytes
    if activation_bytes_per_layer is not None:
        # 1F1B keeps up to pp - r micro-batches alive on rank r: the busiest holds the most
        ranks = pipeline_rank_layers(pipeline_num_layers(cfg.model), p)
        per_layer = activation_bytes_per_layer
        if not isinstance(per_layer, Sequence):
            per_layer = [per_layer] * pipeline_num_layers(cfg.model)
        out["activations"] = max(sum(per_layer[i] for i in held) * (p.pp - r) for r, held in enumerate(ranks))
    out["total"] = sum(out.values())
    return out
