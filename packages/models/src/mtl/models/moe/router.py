"""The top-k router: which experts each token goes to, with what weight, and the router's
auxiliary losses.

- ``softmax`` (Mixtral, Qwen-MoE): probabilities over all experts, the top k kept; with
  ``norm_topk_prob`` they are rescaled to sum to one (Mixtral), else kept as they are (Qwen2-MoE's
  default).
- ``sigmoid`` (DeepSeek-V3): an independent score per expert, the top k kept and (with
  ``norm_topk_prob``) normalised over the k.

Choosing is separate from weighting (DeepSeek-V3, Nemotron-H): an optional per-expert bias
(``expert_bias``, Megatron's ``--moe-router-enable-expert-bias``, HF's ``e_score_correction_bias``)
is added to the scores only to pick the k experts, and group-limited routing first keeps the
``group_top_k`` of ``num_groups`` equal expert groups whose best ``k / group_top_k`` biased scores
sum highest (Megatron's ``group_limited_topk``). The weights are the unbiased scores of the
chosen experts, normalised as above, times ``scaling_factor`` (Megatron's
``--moe-router-topk-scaling-factor``, HF's ``routed_scaling_factor``). The bias is a parameter
without gradient, kept in fp32 and in checkpoints, moved after each step by the aux-loss-free
rule (``expert_bias.py``) from the tokens each expert was chosen for in training forwards.

Logits are computed in fp32 whatever the autocast: routing decisions flip on small
differences, and the losses below need fp32 anyway.

Load-balancing loss (Switch Transformer, as Megatron computes it): ``coeff * E * sum_i f_i * P_i``
with ``f_i`` the share of the ``T * k`` routed slots that went to expert i (counted before any
capacity drop, not differentiable) and ``P_i`` the mean over tokens of expert i's probability
(softmax) or normalised score (sigmoid). Perfect balance gives ``coeff``. Router z-loss (ST-MoE):
``coeff * mean_t logsumexp(logits_t)^2``.

Context parallelism (``parallel.cp > 1``): each cp rank routes only its chunks of every
sequence, so ``f_i`` is taken from the slot counts summed over the cp group (an all-reduce of
a detached ``[E]`` tensor, as Megatron does) over the global slot count ``T * cp * k``, while
``P_i`` stays the mean over this rank's own tokens. Gradients are averaged over dp x cp, so
the effective loss is ``(1/cp) * sum_r coeff * E * sum_i f_i * P_i^r`` = the one-process loss
exactly (``P_i`` of the whole sequence is the mean of the ranks' ``P_i^r``, equal token counts).
The z-loss is a per-token mean and averages correctly as it is. Under TP the tokens are
gathered before routing, so TP ranks already agree and nothing is summed over TP.

Capacity (``capacity_factor``): each expert takes at most ``ceil(T * k * factor / E)`` slots;
past that the slots with the lowest scores are dropped (Megatron's "probs" policy; ranked by
the score before top-k normalisation, which with k = 1 would make every weight one).
A dropped slot contributes nothing; the token keeps its other experts and the residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.models.moe.token_slots import count_per_expert


@dataclass
class Routing:
    """Where the ``T`` tokens of one forward go."""

    probs: torch.Tensor  # [T, k] fp32: each slot's weight in the combination
    expert_ids: torch.Tensor  # [T, k] int64: global expert numbers
    keep: torch.Tensor | None  # [T, k] bool: slots within capacity (None: dropless, all kept)
    aux_loss: torch.Tensor  # [] fp32, the load-balancing loss with its coefficient
    z_loss: torch.Tensor  # [] fp32, the z-loss with its coefficient
    dropped: torch.Tensor  # [] int64: slots dropped for capacity


@torch.compiler.disable
def _sum_over_group(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (detached, no gradient) summed over ``group``. Runs eagerly under
    ``train.compile``: the compiled layer's graph ends before the all-reduce and resumes after."""
    counts = counts.detach().clone()
    dist.all_reduce(counts, group=group)
    return counts


def load_balancing_loss(scores_for_aux: torch.Tensor, expert_ids: torch.Tensor, coeff: float,
                        group=None) -> torch.Tensor:
    """``coeff * E * sum_i f_i * P_i`` from ``scores_for_aux [T, E]`` (rows sum to one) and the
    routed ``expert_ids [T, k]``. ``group`` (the cp group; None: one rank): ``f_i`` counts the
    slots of every rank of the group (see the module docstring), ``P_i`` this rank's tokens."""
    num_tokens, num_experts = scores_for_aux.shape
    slots_per_expert = count_per_expert(expert_ids, num_experts).to(scores_for_aux.dtype)
    total_slots = expert_ids.numel()
    if group is not None:
        slots_per_expert = _sum_over_group(slots_per_expert, group)
        total_slots *= dist.get_world_size(group)
    fraction = slots_per_expert / total_slots  # f_i: sums to one
    mean_prob = scores_for_aux.mean(dim=0)  # P_i
    return coeff * num_experts * torch.sum(fraction * mean_prob)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean(logsumexp(logits)^2)``: keeps the router's logits small (ST-MoE)."""
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def capacity_keep(scores: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: the slots each expert keeps, its ``capacity`` highest-scored ones
    (``scores [T, k]``: each slot's score for its expert)."""
    num_tokens = scores.shape[0]
    if capacity >= num_tokens:  # no expert can receive more than every token once
        return torch.ones_like(expert_ids, dtype=torch.bool)
    dense = torch.zeros(num_tokens, num_experts, dtype=scores.dtype, device=scores.device)
    dense.scatter_(1, expert_ids, scores.detach())  # [T, E]: a token's score for each expert, 0 if not routed
    routed = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, expert_ids, True)
    top_tokens = torch.topk(dense, capacity, dim=0).indices  # [capacity, E]
    within = torch.zeros_like(routed).scatter_(0, top_tokens, True)
    return (routed & within).gather(1, expert_ids)


def group_limited_choice(scores: torch.Tensor, top_k: int, num_groups: int, group_top_k: int) -> torch.Tensor:
    """``scores [T, E]`` with the experts outside each token's ``group_top_k`` best groups set to
    -inf; a group's worth is the sum of its ``top_k // group_top_k`` highest scores."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E/G]
    group_scores = grouped.topk(top_k // group_top_k, dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = torch.topk(group_scores, group_top_k, dim=-1).indices  # [T, group_top_k]
    in_best = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # [T, G]
    return grouped.masked_fill(~in_best.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


class TopKRouter(nn.Module):
    """``weight [E, h]`` (replicated over TP and EP): hidden ``[T, h]`` -> ``Routing``.
    ``cp_group``: the context-parallel group the load-balancing counts are summed over (None at
    cp = 1: no collective). ``expert_bias``, ``num_groups``/``group_top_k``, ``scaling_factor`` and
    ``bias_update_rate`` (0: the bias stays as loaded): see the module docstring."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, score_function: str,
                 norm_topk_prob: bool, aux_loss_coeff: float, z_loss_coeff: float,
                 capacity_factor: float | None, init_std: float = 0.02, cp_group=None,
                 expert_bias: bool = False, scaling_factor: float = 1.0, num_groups: int = 1,
                 group_top_k: int = 1, bias_update_rate: float = 0.0):
        super().__init__()
        self.cp_group = cp_group
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.norm_topk_prob = score_function, norm_topk_prob
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor = capacity_factor
        self.scaling_factor, self.num_groups, self.group_top_k = scaling_factor, num_groups, group_top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        tag_init(self.weight, "normal")
        nn.init.normal_(self.weight, std=init_std)
        self.expert_bias = None
        self.bias_update_rate = bias_update_rate
        if expert_bias:  # no gradient: fp32 state the initialiser and the optimizer leave alone
            self.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            # slots per expert since the last bias update (summed over the step's micro-batches)
            self.register_buffer("tokens_since_update", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores [T, E]`` -> ``expert_ids [T, k]``: biased and group-limited where configured."""
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.num_groups > 1:
            choice = group_limited_choice(choice, self.top_k, self.num_groups, self.group_top_k)
        return torch.topk(choice, self.top_k, dim=-1).indices

    def forward(self, hidden: torch.Tensor) -> Routing:
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), self.weight.float())  # [T, E] fp32
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
            scores_for_aux = scores
        else:
            scores = torch.sigmoid(logits)
            scores_for_aux = scores / scores.sum(dim=-1, keepdim=True)
        expert_ids = self.choose(scores)  # [T, k]
        if self.expert_bias is not None and self.bias_update_rate and self.training and torch.is_grad_enabled():
            self.tokens_since_update += count_per_expert(expert_ids.detach(), self.num_experts)
        top_scores = scores.gather(1, expert_ids)  # [T, k], unbiased
        probs = top_scores / top_scores.sum(dim=-1, keepdim=True) if self.norm_topk_prob else top_scores
        if self.scaling_factor != 1.0:
            probs = probs * self.scaling_factor
        zero = logits.new_zeros(())
        aux = (load_balancing_loss(scores_for_aux, expert_ids, self.aux_loss_coeff, self.cp_group)
               if self.aux_loss_coeff else zero)
        zl = z_loss(logits, self.z_loss_coeff) if self.z_loss_coeff else zero
        keep, dropped = None, torch.zeros((), dtype=torch.int64, device=hidden.device)
        if self.capacity_factor:
            capacity = math.ceil(hidden.shape[0] * self.top_k * self.capacity_factor / self.num_experts)
            keep = capacity_keep(top_scores, expert_ids, self.num_experts, capacity)
            dropped = (~keep).sum()
        return Routing(probs, expert_ids, keep, aux, zl, dropped)
