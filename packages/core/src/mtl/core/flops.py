"""Family-independent size and memory arithmetic. A family's own formulas (FLOPs per
iteration, activations per layer) come with its ``ModelFamily`` record; core holds none."""

from __future__ import annotations

from torch import nn

from mtl.core.config import RunConfig, pipeline_num_layers, pipeline_rank_layers


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


def gather_unit_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameters of the largest layer, parameters outside the layers) of ``model``: what
    ``parallel.sharding = "parameters"`` holds whole at once besides the shards (its gather
    units are the model's ``compile_units()``)."""
    units_of = getattr(model, "compile_units", None)
    units = list(units_of()) if callable(units_of) else []
    in_units = {id(p) for unit in units for p in unit.parameters()}
    largest = max((sum(p.numel() for p in unit.parameters()) for unit in units), default=0)
    return largest, sum(p.numel() for p in model.parameters() if id(p) not in in_units)


def memory_per_gpu_bytes(cfg: RunConfig, num_parameters: int, activation_bytes_per_layer: float | None,
                         num_expert_parameters: int = 0, unit_parameters: tuple[int, int] | None = None,
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
    bucket is a layer or ``parallel.bucket_size_mb``, whichever is smaller)
    and the gradients outside the layers, and under "parameters" two layers' weights (the one
    running and the next one's gather) and the weights outside the layers, gathered for the
    whole step; ``unit_parameters`` = (largest layer, outside the layers) before tp x pp,
    from ``gather_unit_sizes``. Activations: one micro-batch per in-flight pipeline stage on
    the rank that keeps the most (``activation_bytes_per_layer`` from the family; left out when
    it has none)."""
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
        layer, outside = (n / split for n in unit_parameters)
        # a bucket ends at a layer's end or at parallel.bucket_size_mb (of the weights' dtype), whichever first
        bucket = min(layer, p.bucket_size_mb * 2**20 / weight_bytes)
        out["grads"] += (2 * bucket + outside) * 4
        if level == 3:
            out["weights"] += (2 * layer + outside) * weight_bytes
    if activation_bytes_per_layer is not None:
        # 1F1B keeps up to pp - r micro-batches alive on rank r: the busiest holds the most
        ranks = pipeline_rank_layers(pipeline_num_layers(cfg.model), p)
        out["activations"] = activation_bytes_per_layer * max(len(held) * (p.pp - r) for r, held in enumerate(ranks))
    out["total"] = sum(out.values())
    return out
