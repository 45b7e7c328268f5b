"""Family-independent size and memory arithmetic. A family's own formulas (FLOPs per
iteration, activations per layer) come with its ``ModelFamily`` record; core holds none."""

from __future__ import annotations

from torch import nn

from mtl.core.config import RunConfig, pipeline_rank_layers


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


def memory_per_gpu_bytes(cfg: RunConfig, num_parameters: int, activation_bytes_per_layer: float | None,
                         num_expert_parameters: int = 0) -> dict[str, float]:
    """A coarse estimate per GPU: weights, gradients, Adam state (sharded with the distributed
    optimizer) of ``num_parameters`` (the whole model's) split over tp x pp, of which the
    ``num_expert_parameters`` (``param.expert_split_dim``) are also split over ep and their Adam
    state sharded over the dp / ep ranks holding the same experts; and the activations of one
    micro-batch per in-flight pipeline stage on the rank that keeps the most (``activation_bytes_per_layer``
    from the family; left out when it has none)."""
    p, t = cfg.parallel, cfg.train
    dense = (num_parameters - num_expert_parameters) / (p.tp * p.pp)
    experts = num_expert_parameters / (p.tp * p.pp * p.ep)
    params = dense + experts
    bytes_weights = params * (2 + 4 if t.precision != "fp32" else 4)  # bf16 copy + fp32 master
    bytes_grads = params * 4
    adam = (dense * 8 / p.dp + experts * 8 / (p.dp // p.ep)) if p.distributed_optimizer else params * 8
    out = {"weights": bytes_weights, "grads": bytes_grads, "optimizer": adam}
    if activation_bytes_per_layer is not None:
        # 1F1B keeps up to pp - r micro-batches alive on rank r: the busiest holds the most
        ranks = pipeline_rank_layers(cfg.model.num_layers, p)
        out["activations"] = activation_bytes_per_layer * max(len(held) * (p.pp - r) for r, held in enumerate(ranks))
    out["total"] = sum(out.values())
    return out
