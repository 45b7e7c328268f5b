"""``mtl train --dry-run``: what a run would be, without running it.

Everything about the model comes from the selected family: the parameter counts from the
model it builds on the meta device (whatever its layers are), the FLOPs and activation
memory from its ``ModelFamily`` record (left out, and said so, when it has no formula)."""

from __future__ import annotations

import os

import torch

from mtl.cli.launch import resolve_at
from mtl.core.config import RunConfig, layer_and_head_flops, pipeline_num_layers, pipeline_rank_layers
from mtl.core.config_io import format_config
from mtl.core.flops import gather_unit_sizes, memory_per_gpu_bytes, parameter_counts
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.parallel.ddp.reduce_group import is_expert_param
from mtl.parallel.topology import Topology


def module_tree(module: torch.nn.Module, max_depth: int = 3) -> list[str]:
    """One line per module down to ``max_depth``, with its parameter count; repeated
    siblings of the same shape (the layers) are shown once with a multiplier."""
    lines: list[str] = []

    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    seen: set[int] = set()  # parameters already shown (tied embeddings appear twice)

    def walk(m: torch.nn.Module, name: str, depth: int) -> None:
        params = list(m.parameters())
        shared = params and all(id(p) in seen for p in params)
        note = " (shared, counted above)" if shared and depth > 0 else ""
        lines.append(f"{'  ' * depth}{name} ({type(m).__name__}): {count(m):,}{note}")
        if depth >= max_depth:
            seen.update(id(p) for p in params)
            return
        children = list(m.named_children())
        i = 0
        while i < len(children):
            child_name, child = children[i]
            j = i
            while j + 1 < len(children) and repr(children[j + 1][1]) == repr(child):
                j += 1
            if j > i:
                lines.append(f"{'  ' * (depth + 1)}{child_name}..{children[j][0]}: {j - i + 1} x "
                             f"{type(child).__name__}, {count(child):,} each")
                walk(child, f"{child_name} (each)", depth + 2)
            else:
                walk(child, child_name, depth + 1)
            i = j + 1
        seen.update(id(p) for p in params)  # after the children: they compare with earlier subtrees

    walk(module, "model", 0)
    return lines


def human_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"


def pipeline_shares(cfg: RunConfig, layer_flops: list[float], head_flops: float) -> str:
    """One line: each pipeline rank's layers and share of the iteration's FLOPs (the last rank
    also runs the LM head, whatever the family counts beyond its layers). The busiest rank sets
    the step; by default the stages are sized by these counts (``parallel.pipeline_split``),
    ``parallel.virtual_stage_layers`` sizes them by hand."""
    p = cfg.parallel
    total = sum(layer_flops) + head_flops
    held = pipeline_rank_layers(pipeline_num_layers(cfg.model), p)
    flops = [sum(layer_flops[i] for i in layers) for layers in held]
    flops[-1] += head_flops
    shares = [f"rank {r} {100 * f / total:.1f}% ({len(held[r])} layer{'s' if len(held[r]) != 1 else ''}"
              f"{' + LM head' if r == p.pp - 1 else ''})" for r, f in enumerate(flops)]
    return "pipeline ranks' share of the FLOPs (the busiest sets the step): " + ", ".join(shares)


def runs_on_cpu(cfg: RunConfig) -> bool:
    return cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())


def meta_model(cfg: RunConfig):
    """(family, backend, the whole model built on the meta device) of a resolved config."""
    backend = registry("backend").get(cfg.model.backend)
    family = registry("model family").get(cfg.model.family)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = build_model(family, cfg, Topology.single(), backend)
    return family, backend, model


def estimated_memory(cfg: RunConfig, family, model) -> dict[str, float]:
    """The memory per rank ``--dry-run`` prints (``mtl.core.flops.memory_per_gpu_bytes``)."""
    activations = family.activation_bytes_per_layer(cfg) if family.activation_bytes_per_layer else None
    experts = sum(q.numel() for q in model.parameters() if is_expert_param(q))
    return memory_per_gpu_bytes(cfg, parameter_counts(model)["total"], activations, num_expert_parameters=experts,
                                unit_parameters=gather_unit_sizes(model))


def dry_run(cfg: RunConfig, world_size: int | None = None) -> str:
    """The summary first (model, parameters, FLOPs, layout, memory), then the module tree and
    the parameters per component, then the resolved config (the longest part) last.
    ``world_size``: that of ``--nproc-per-node``, else torchrun's, else the smallest the
    layout needs."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp))
    cfg = resolve_at(cfg, world_size)  # the optimizer's and checkpoint schedule's checks included
    family, backend, model = meta_model(cfg)
    p = cfg.parallel
    counts = parameter_counts(model)  # padded vocabulary rows included, as the model holds them
    memory = estimated_memory(cfg, family, model)
    if family.flops_per_iteration is not None:
        flops = family.flops_per_iteration(cfg)
        flops_line = f"FLOPs per iteration: {flops:.4e} ({flops / 1e12:.2f} TFLOP, Megatron's count)"
    else:
        flops_line = f"FLOPs per iteration: not counted (model family '{family.name}' gives no flops_per_iteration)"
    per = "process" if runs_on_cpu(cfg) else "GPU"  # a CPU run's memory is each process's
    out = ["# summary",
           f"model: {type(model).__name__} of family '{family.name}', backend '{backend.name}', "
           f"{pipeline_num_layers(cfg.model)} layers, hidden {cfg.model.hidden_size}, sequence {cfg.model.seq_length}",
           f"parameters: {counts['total']:,}",
           flops_line,
           (f"world size {p.world_size}: tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {p.dp}; "
            f"{cfg.train.num_micro_batches} micro-batches of {cfg.train.micro_batch_size} per step"),
           f"estimated memory per {per}: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in memory.items())]
    shares = layer_and_head_flops(cfg) if p.pp > 1 else None
    if shares is not None:
        out.append(pipeline_shares(cfg, *shares))
    out += ["", f"# model (whole model, one process; family '{family.name}')", *module_tree(model)]
    out += ["", "# parameters per component", *(f"{name:>14}: {value:,}" for name, value in counts.items())]
    out += ["", "# resolved config", format_config(cfg)]
    return "\n".join(out)
