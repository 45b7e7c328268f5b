"""What the MoE converters (Mixtral, Qwen2-MoE, Qwen3-MoE, Nemotron-H's experts) share: the expert tensors, the
router's config keys, and which layers are MoE.

HF checkpoints keep one tensor per expert and projection (``experts.{e}.w1.weight`` or
``experts.{e}.gate_proj.weight`` ``[ffn, h]``, the way ``save_pretrained`` writes them);
ours stack them: ``experts.linear_fc1.weight [E, 2, ffn, h]`` (gate, up per expert) and
``experts.linear_fc2.weight [E, h, ffn]`` (``mtl.models.moe.experts``); non-gated experts
(Nemotron-H's ``up_proj``/``down_proj``) stack to ``[E, ffn, h]`` and ``[E, h, ffn]``.

HF's load-balancing loss (``router_aux_loss_coef``) sums its per-choice token fractions over
the k choices, so it is k times ours (``mtl.models.moe.router``) for the same coefficient, and
it is one loss over the tokens of all MoE layers pooled (``load_balancing_loss_func``), where
ours adds one loss per MoE layer: each router gets the gradient HF gives it with
``moe_aux_loss_coeff = top_k * router_aux_loss_coef / num_moe_layers``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read


def experts_to_mtl(hf_prefix: str, ours: str, num_experts: int, names: tuple[str, ...],
                   read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_prefix{e}.{name}.weight`` for every expert -> our two stacked tensors. ``names``:
    (gate, up, down) of SwiGLU experts, or (up, down) of non-gated ones (Nemotron-H), whose
    fc1 is ``[E, ffn, h]``."""
    *fc1_names, down = names
    fc1 = [torch.stack([read(f"{hf_prefix}{e}.{name}.weight") for name in fc1_names]) for e in range(num_experts)]
    fc1 = torch.stack(fc1)  # [E, 2, ffn, h] gated, [E, 1, ffn, h] not
    yield ours + "experts.linear_fc1.weight", fc1 if len(fc1_names) == 2 else fc1.squeeze(1)
    del fc1
    yield ours + "experts.linear_fc2.weight", torch.stack([read(f"{hf_prefix}{e}.{down}.weight")
                                                           for e in range(num_experts)])  # [E, h, ffn]


def experts_from_mtl(hf_prefix: str, ours: str, num_experts: int, names: tuple[str, ...],
                     read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``experts_to_mtl``."""
    *fc1_names, down = names
    fc1 = read(ours + "experts.linear_fc1.weight")
    if len(fc1_names) == 1:
        fc1 = fc1.unsqueeze(1)  # [E, 1, ffn, h]
    for e in range(num_experts):
        for part, name in enumerate(fc1_names):
            yield f"{hf_prefix}{e}.{name}.weight", fc1[e, part]
    del fc1
    fc2 = read(ours + "experts.linear_fc2.weight")
    for e in range(num_experts):
        yield f"{hf_prefix}{e}.{down}.weight", fc2[e]


def router_section(hf: dict[str, Any], num_experts: int, norm_topk_prob: bool, num_moe_layers: int) -> dict[str, Any]:
    """The ``[model]`` MoE keys every HF softmax router shares."""
    top_k, layers = hf["num_experts_per_tok"], max(1, num_moe_layers)
    return {
        "num_experts": num_experts,
        "moe_top_k": top_k,
        "moe_router": "softmax",
        "moe_norm_topk_prob": norm_topk_prob,
        "moe_aux_loss_coeff": top_k * float(hf.get("router_aux_loss_coef", 0.001)) / layers,
    }


def router_config(m) -> dict[str, Any]:
    layers = max(1, len(m.moe_layers))
    return {"num_experts_per_tok": m.moe_top_k, "router_aux_loss_coef": m.moe_aux_loss_coeff * layers / m.moe_top_k,
            "output_router_logits": False}


def check_moe_exportable(m, architecture: str, *, norm_topk_prob: bool | None = None) -> None:
    """What every HF MoE architecture needs: experts, a softmax router, SwiGLU experts."""
    if not m.num_experts:
        raise ConfigError(f"{architecture} export needs model.num_experts > 0 (this model is dense)")
    if m.moe_router != "softmax":
        raise ConfigError(f"{architecture} export: model.moe_router = {m.moe_router!r}; {architecture} routes by softmax")
    if m.activation != "swiglu":
        raise ConfigError(f"{architecture} export: model.activation = {m.activation!r}; its experts are SwiGLU")
    if norm_topk_prob is not None and m.moe_norm_topk_prob != norm_topk_prob:
        raise ConfigError(
            f"{architecture} export needs model.moe_norm_topk_prob = {str(norm_topk_prob).lower()} "
            f"(have {str(m.moe_norm_topk_prob).lower()})"
        )
