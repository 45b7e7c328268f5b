"""Mixture of experts: top-k router, grouped-GEMM experts, token dispatch, the MoE layer,
its auxiliary losses (counted in backward), the aux-loss-free expert-bias update and per-step metrics."""

from mtl.models.moe.aux_loss import attach_aux_loss, set_aux_loss_scale
from mtl.models.moe.dispatch import LocalDispatcher, build_dispatcher
from mtl.models.moe.experts import GroupedExperts
from mtl.models.moe.expert_bias import update_expert_biases
from mtl.models.moe.metrics import moe_step_metrics
from mtl.models.moe.moe_layer import MoELayer, MoESubmodules
from mtl.models.moe.router import Routing, TopKRouter
from mtl.models.moe.token_slots import TokenDispatcher

__all__ = [
    "GroupedExperts", "LocalDispatcher", "MoELayer", "MoESubmodules", "Routing", "TokenDispatcher", "TopKRouter",
    "attach_aux_loss", "build_dispatcher", "moe_step_metrics", "set_aux_loss_scale", "update_expert_biases",
]
