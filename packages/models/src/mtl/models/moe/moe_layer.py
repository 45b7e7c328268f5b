"""The MoE layer: the MLP slot of a transformer layer as a router over expert MLPs, plus an
optional shared expert every token goes through (Qwen2-MoE: scaled by a sigmoid gate).

Tensor parallelism (with or without sequence parallelism), activations ``[s(/tp), b, h]``:

    x [s/tp, b, h] --gather over TP (SP)--> tokens [T = s*b, h], the same on every TP rank
    router(tokens): computed whole on every rank (replicated weight, same result)
    dispatcher(tokens, routing, experts): each rank runs its ffn/tp slice of every expert;
        the slices' partial sums are all-reduced before they are weighted, so everything
        after the experts is complete and identical on every TP rank
    out [T, h] --keep this rank's part of the sequence (SP)--> [s/tp, b, h]

Gradients: the router's and everything downstream of the all-reduce are complete on each TP
rank, so the router weight needs no reduction; the experts' input gradient is a partial sum
per rank and is all-reduced where the tokens enter them (``copy_to_tensor_parallel``). The
gathered input therefore sends back only this rank's slice of a complete gradient. Under SP
the shared-expert gate (replicated) sees only this rank's tokens: it is marked for the
per-step sum over TP (``mtl.parallel.sequence_parallel_grads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.core.spec import build_module
from mtl.models.moe.aux_loss import attach_aux_loss
from mtl.models.moe.dispatch import build_dispatcher
from mtl.models.moe.experts import GroupedExperts
from mtl.models.moe.metrics import MoEStats
from mtl.models.moe.router import TopKRouter
from mtl.parallel.sequence_parallel_grads import mark_sequence_parallel_grad
from mtl.parallel.tensor_parallel import mappings


@dataclass(frozen=True)
class MoESubmodules:
    shared_experts: Any = None  # a dense MLP spec, or None


class MoELayer(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        ffn_hidden_size: int,
        activation: str,
        router: str,
        norm_topk_prob: bool,
        aux_loss_coeff: float,
        z_loss_coeff: float,
        capacity_factor: float | None,
        shared_expert_gate: bool,
        init_std: float,
        output_init_std: float,
        sequence_parallel: bool,
        aux_loss_scale: float,
        topology,
        submodules: MoESubmodules,
        norm: nn.Module | None = None,
        # DeepSeek-V3 / Nemotron-H routing (router.py); the defaults route as Mixtral and Qwen do
        router_expert_bias: bool = False,
        router_scaling_factor: float = 1.0,
        router_num_groups: int = 1,
        router_group_top_k: int = 1,
        router_bias_update_rate: float = 0.0,
    ):
        super().__init__()
        self.tp_group = topology.tp_group if topology is not None else None
        self.sequence_parallel = sequence_parallel and self.tp_group is not None
        self.norm = norm  # a backend's fused pre-MLP norm arrives here: applied first
        self.router = TopKRouter(
            hidden_size=hidden_size, num_experts=num_experts, top_k=top_k, score_function=router,
            norm_topk_prob=norm_topk_prob, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
            capacity_factor=capacity_factor, init_std=init_std,
            cp_group=topology.group("cp") if topology is not None else None,  # see router.py
            expert_bias=router_expert_bias, scaling_factor=router_scaling_factor,
            num_groups=router_num_groups, group_top_k=router_group_top_k, bias_update_rate=router_bias_update_rate,
        )
        self.experts = GroupedExperts(
            num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
            activation=activation, init_std=init_std, output_init_std=output_init_std, topology=topology,
        )
        self.dispatcher = build_dispatcher(num_experts, topology)
        self.shared_experts = None
        self.shared_experts_gate = None
        if submodules.shared_experts is not None:
            self.shared_experts = build_module(submodules.shared_experts, topology=topology)
            if shared_expert_gate:  # [h] -> 1, replicated over TP
                self.shared_experts_gate = nn.Linear(hidden_size, 1, bias=False)
                tag_init(self.shared_experts_gate.weight, "normal")
                nn.init.normal_(self.shared_experts_gate.weight, std=init_std)
                if self.sequence_parallel:  # each rank gates its own tokens: a partial gradient
                    mark_sequence_parallel_grad(self.shared_experts_gate.weight)
        self.aux_loss_scale = aux_loss_scale  # see mtl.models.moe.aux_loss
        self.stats = MoEStats()

    def _run_experts(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The dispatcher's ``experts``: complete outputs, summed over the TP ranks' ffn slices."""
        tokens = mappings.copy_to_tensor_parallel(tokens, self.tp_group)  # backward: sum the partial input grads
        partial = self.experts(tokens, tokens_per_expert)  # [N, h], this rank's ffn slice
        return mappings.reduce_from_tensor_parallel(partial, self.tp_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h]."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        full = hidden
        if self.sequence_parallel:  # the gradient that comes back is complete: keep this rank's slice
            full = mappings.gather_from_sequence_parallel(hidden, self.tp_group, grad_is_partial=False)
        seq, batch, width = full.shape
        tokens = full.reshape(seq * batch, width)  # [T, h]
        routing = self.router(tokens)
        combined = self.dispatcher(tokens, routing.probs, routing.expert_ids, routing.keep, self._run_experts)
        output = combined.view(seq, batch, width)
        if self.sequence_parallel:
            output = mappings.scatter_to_sequence_parallel(output, self.tp_group)  # [s/tp, b, h]
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden)  # [s(/tp), b, h]; its linears do their own TP
            if self.shared_experts_gate is not None:
                gate = torch.sigmoid(F.linear(hidden, self.shared_experts_gate.weight))  # [s(/tp), b, 1]
                shared = gate * shared
            output = output + shared
        output = attach_aux_loss(output, routing.aux_loss + routing.z_loss, self.aux_loss_scale)
        if self.training:  # last: outside torch.compile's graph (see MoEStats.record)
            self.stats.record(routing.aux_loss, routing.z_loss, routing.dropped, routing.expert_ids.numel())
        return output
