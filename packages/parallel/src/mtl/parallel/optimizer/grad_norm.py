"""The global gradient L2 norm over every parallel group, clipping, and a NaN-loss check.

Each element of the model's gradient is counted exactly once, by the parameter's ``ParamLayout``
(``mtl.parallel.param_layout``):

- a TP-split parameter (``tp_split_dim`` set) holds a different slice on each TP rank:
  its squares are summed over the TP group;
- a replicated parameter is the same on every TP rank: only ``tp_rank == 0`` counts it;
- pipeline stages hold different layers: summed over the pipeline group; the last stage's
  copy of a tied embedding (``shared_embedding`` on a stage other than the first)
  repeats the first stage's and is not counted;
- under ZeRO-2/3 a rank holds nothing but that range (``param.dp_owned_grad``); under hybrid
  sharding the shards repeat over the replica blocks and are summed over one block only;
- with the distributed optimizer each dp x cp rank holds the reduced gradient of its own
  flat range of each parameter only (``param.dp_owned_grad_range``): that range is counted
  and the squares are summed over ``dp_cp`` too. Without it the gradients are identical
  across dp x cp and counted as they are.
- expert parameters (``expert_split_dim`` set) differ across the expert-parallel group
  (each rank holds other experts): without the distributed optimizer their squares are
  summed over ``ep`` (they are identical across the ranks holding the same experts); with it
  each of those ranks holds its own shard, and the ``dp_cp`` sum (= ep x edp_cp) covers every
  expert once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from mtl.core.errors import MtlError, ParallelError
from mtl.parallel.ddp.grad_buffer import accumulated_grad
from mtl.parallel.ddp.reduce_group import is_expert_param
from mtl.parallel.param_layout import param_layout
from mtl.parallel.topology import Topology

# As torch.nn.utils.clip_grad_norm_: keeps the coefficient finite for a zero norm.
CLIP_EPS = 1e-6


def _counted_grad(param: nn.Parameter, topology: Topology, grads_are_dp_sharded: bool) -> torch.Tensor | None:
    """The part of the gradient (``accumulated_grad``) this rank contributes to the norm
    (None: nothing)."""
    if param_layout(param).tp_split_dim is None and topology.tp_rank != 0:
        return None
    if param_layout(param).shared_embedding and not topology.is_first_stage:
        return None
    if not grads_are_dp_sharded:
        return accumulated_grad(param)
    if getattr(param, "dp_owned_grad", None) is not None:  # ZeRO-2/3: only the shard exists
        return param.dp_owned_grad
    owned = getattr(param, "dp_owned_grad_range", None)
    if owned is None:
        raise ParallelError(
            f"clip_grad_norm(grads_are_dp_sharded=True) got a parameter of shape {tuple(param.shape)} "
            "that no DataParallel(use_distributed_optimizer=True) shards; wrap the model with the "
            "distributed optimizer enabled or pass grads_are_dp_sharded=False"
        )
    first, last = owned
    return accumulated_grad(param).reshape(-1)[first:last]


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
    if grads[0].device.type == "cpu":
        # The CPU's fp32 norm kernel sums in sequence: 1e-5 relative on a 1M-element gradient,
        # and another error for each TP shard of it, enough to change the clip coefficient
        # between layouts. CUDA's kernel sums by tree; on the CPU float64 costs little.
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum().float()
    return torch.stack(torch._foreach_norm(grads, 2)).square().sum()


def _collective_device(fallback: torch.device | None = None) -> torch.device:
    """Where a tensor for an all-reduce must live: the current CUDA device under NCCL."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback is not None else torch.device("cpu")


def _rank_squares(params: list, topology: Topology, grads_are_dp_sharded: bool,
                  device: torch.device) -> torch.Tensor:
    """The sum of squares this rank counts of ``params``' gradients (an fp32 scalar)."""
    counted = [_counted_grad(p, topology, grads_are_dp_sharded) for p in params]
    grads = [g for g in counted if g is not None]
    # Gradients not counted (copies of ones another rank counts) still take part with weight
    # 0: finite -> +0, inf/NaN -> NaN, so any non-finite element anywhere shows in the result.
    uncounted = [_held_grad(p) for p, g in zip(params, counted) if g is None]
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        squares = squares + _sum_of_squares(grads)
    if uncounted:
        squares = squares + 0.0 * _sum_of_squares(uncounted)
    return squares


def _held_grad(param: nn.Parameter) -> torch.Tensor | None:
    """What this rank holds of ``param``'s gradient: the whole (``accumulated_grad``), or under
    ZeRO-2/3 only its reduced shard."""
    grad = accumulated_grad(param)
    return grad if grad is not None else getattr(param, "dp_owned_grad", None)


def global_grad_norm(params, topology: Topology, grads_are_dp_sharded: bool = False,
                     shard_group="dp_cp") -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same fp32 scalar on every rank.
    ``shard_group``: what sharded gradients are split over (a topology group's name, or under
    hybrid sharding the shard block's group itself)."""
    unique = list({id(p): p for p in params if _held_grad(p) is not None}.values())
    # A rank may hold no gradient here (a distributed-optimizer rank whose shards are all
    # padding); it still joins the all-reduces, on the device NCCL needs.
    device = _held_grad(unique[0]).device if unique else _collective_device()
    dense = _rank_squares([p for p in unique if not is_expert_param(p)], topology, grads_are_dp_sharded, device)
    experts = _rank_squares([p for p in unique if is_expert_param(p)], topology, grads_are_dp_sharded, device)
    ep_group = topology.group("ep")
    if ep_group is not None and not grads_are_dp_sharded:  # other ranks hold other experts
        dist.all_reduce(experts, group=ep_group)
    squares = dense + experts
    for name in ("tp_pp",) + ((shard_group,) if grads_are_dp_sharded else ()):
        group = topology.group(name) if isinstance(name, str) else name
        if group is not None:
            dist.all_reduce(squares, group=group)
    return squares.sqrt()


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, topology: Topology, grads_are_dp_sharded: bool = False,
                   shard_group="dp_cp") -> float:
    """Scale every gradient so the global L2 norm is at most ``max_norm``; return the norm
    before clipping.

    A non-finite result (inf/NaN on any rank: the all-reduce spreads it) is the ``found_inf``
    signal: gradients are then left as they are and the caller skips the step. Pass
    ``max_norm = inf`` to only measure."""
    if not max_norm > 0:
        raise ParallelError(f"clip_grad_norm max_norm = {max_norm!r} must be > 0 (train.clip_grad; use inf to only measure)")
    params = list({id(p): p for p in params if _held_grad(p) is not None}.values())
    total = global_grad_norm(params, topology, grads_are_dp_sharded, shard_group)
    total_value = total.item()
    if math.isfinite(total_value) and math.isfinite(max_norm):
        coef = max_norm / (total_value + CLIP_EPS)
        if coef < 1.0 and params:
            torch._foreach_mul_([_held_grad(p) for p in params], coef)
    return total_value


def check_for_nan(loss: torch.Tensor | None, topology: Topology, *, raise_error: bool = True) -> bool:
    """True if the loss is inf/NaN on any rank (the same answer everywhere); raises, naming
    the ranks, unless ``raise_error=False``. ``loss=None`` (a stage without a loss) is fine."""
    world = topology.world_size
    device = _collective_device(loss.device if loss is not None else None)
    bad = torch.zeros(world, dtype=torch.float32, device=device)
    if loss is not None and not torch.isfinite(loss.detach()).all():
        bad[topology.rank] = 1.0
    if world > 1:
        dist.all_reduce(bad)
    bad_ranks = bad.nonzero().flatten().tolist()
    if bad_ranks and raise_error:
        raise MtlError(
            f"loss is NaN or inf on rank(s) {bad_ranks} of {world}; lower train.lr, use bf16 "
            "instead of fp16 (or loss scaling), or check that batch's data"
        )
    return bool(bad_ranks)
