"""The Mamba-2 mixer: in-projection -> depthwise causal conv over (x, B, C) -> SSD scan -> gated
RMSNorm -> out-projection, split over TP by whole groups of SSM heads.

The in-projection packs, per group ``g`` of ``heads_per_group`` heads, the rows
``[z_g, x_g, B_g, C_g, dt_g]`` (``hpg*P, hpg*P, N, N, hpg``): group-major, as gpt's fused QKV, so
a column-parallel split of its rows is a split over groups and the global tensor does not depend
on TP (checkpoints reshard it as any dim-0 split; ``mtl.models.param_layout``). The convolution's
channels are ``[x_g, B_g, C_g]`` per group, likewise. The HF converter permutes these rows to
HF's ``[z, x, B, C, dt]``. Per-head parameters (``A_log``, ``dt_bias``, ``D``) and the gated norm
(per group) split with their heads; the out-projection is row-parallel.

With an ``InferenceContext`` the layer keeps, per sequence, the conv state (the last ``k - 1``
inputs of the convolution) and the SSM state ``[b, h, p, n]``: a prompt runs the chunked scan
from zero, each later token one step of the recurrence, so decoding costs the same per token
whatever the position.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.core.spec import build_module
from mtl.models.initialization import tag_weights
from mtl.models.mamba.conv import causal_conv
from mtl.models.mamba.dispatch import ssd_scan
from mtl.models.mamba.context_parallel import to_head_sharded, to_sequence_sharded
from mtl.models.mamba.gated_norm import GatedRMSNorm, gated_rms_norm
from mtl.models.mamba.initialization import mark_ssm_init
from mtl.models.mamba.ssd import ssd_step
from mtl.parallel.param_layout import set_param_layout


def _split_param(shape: tuple[int, ...], kind: str) -> nn.Parameter:
    """A parameter split over TP on dim 0 (this rank's heads or groups), tagged for init."""
    param = tag_init(nn.Parameter(torch.empty(shape)), kind)
    set_param_layout(param, tp_split_dim=0)
    return param


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        *,
        layer_number: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        num_groups: int,
        state_dim: int,
        conv_kernel: int,
        chunk_size: int,
        dt_min: float,
        norm_eps: float,
        init_std: float,
        output_init_std: float,
        sequence_parallel: bool,
        topology,
        column_linear: Any,
        row_linear: Any,
    ):
        super().__init__()
        tp = topology.tp
        self.layer_number = layer_number
        self.head_dim, self.state_dim, self.chunk_size = head_dim, state_dim, chunk_size
        self.dt_min = dt_min
        self.heads_per_group = num_heads // num_groups
        self.local_groups, self.local_heads = num_groups // tp, num_heads // tp
        # context parallelism: the conv and scan of each cp rank take 1/cp of the local groups
        self.cp, self.cp_rank, self.cp_group = topology.cp, topology.cp_rank, topology.cp_group
        # per group: [z_g | x_g | B_g | C_g | dt_g]
        self.group_widths = (self.heads_per_group * head_dim, self.heads_per_group * head_dim + 2 * state_dim,
                             self.heads_per_group)
        self.in_proj = build_module(column_linear, hidden_size, num_groups * sum(self.group_widths), bias=False,
                                    init_std=init_std, topology=topology, sequence_parallel=sequence_parallel)
        tag_weights(self.in_proj, "normal")
        conv_channels = self.local_groups * self.group_widths[1]
        # placeholders "zeros": the SSM rules draw them (mamba/initialization.py)
        self.conv_weight = mark_ssm_init(_split_param((conv_channels, 1, conv_kernel), "zeros"), "conv_weight")
        self.conv_bias = _split_param((conv_channels,), "zeros")
        self.A_log = mark_ssm_init(_split_param((self.local_heads,), "zeros"), "a_log")
        self.dt_bias = mark_ssm_init(_split_param((self.local_heads,), "zeros"), "dt_bias")
        self.D = _split_param((self.local_heads,), "ones")
        self.norm = GatedRMSNorm(self.local_heads * head_dim, self.heads_per_group * head_dim, norm_eps)
        set_param_layout(self.norm.weight, tp_split_dim=0)
        self.out_proj = build_module(row_linear, num_heads * head_dim, hidden_size, bias=False,
                                     init_std=output_init_std, topology=topology, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel)
        tag_weights(self.out_proj, "residual_output")  # writes into the residual stream: the scaled init

    def extra_repr(self) -> str:
        return (f"heads={self.local_heads} of {self.head_dim} (local), groups={self.local_groups} (local), "
                f"state={self.state_dim}, conv={self.conv_weight.shape[-1]}, chunk={self.chunk_size}")

    def forward(self, hidden: torch.Tensor, inference_context=None) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h]."""
        projected = self.in_proj(hidden)  # [s, b, local_groups * sum(group_widths)]
        projected = projected.view(*projected.shape[:2], self.local_groups, -1)  # [s, b, G_l, sum(widths)]
        if self.cp > 1:  # [s/cp, b, G_l, *] -> [s, b, G_l/cp, *]: the whole sequence, a share of the heads
            projected = to_head_sharded(projected, self.cp, self.cp_group)
        s, b, groups = projected.shape[:3]
        heads = groups * self.heads_per_group
        conv_weight, conv_bias, A_log, dt_bias, D, norm_weight = self._cp_share(groups)
        z, xbc, dt = projected.split(self.group_widths, dim=-1)
        states = self._cached_states(inference_context)
        # [s, b, G_l, x B C] -> [b, channels, s], the convolution's layout
        conv_in = xbc.permute(1, 2, 3, 0).reshape(b, -1, s)
        conv_out, conv_state = causal_conv(conv_in, conv_weight, conv_bias, states[0] if states is not None else None)
        conv_out = conv_out.view(b, groups, -1, s).permute(0, 3, 1, 2)  # [b, s, G_l, x B C]
        x, B, C = conv_out.split([self.group_widths[0], self.state_dim, self.state_dim], dim=-1)
        x = x.reshape(b, s, heads, self.head_dim)
        dt = F.softplus(dt.permute(1, 0, 2, 3).reshape(b, s, heads).float() + dt_bias.float())
        dt = dt.clamp(min=self.dt_min) if self.dt_min > 0 else dt  # [b, s, H_l]
        A = -torch.exp(A_log.float())
        y, ssm_state = self._scan(x.float(), dt, A, B.float(), C.float(), states[1] if states is not None else None)
        y = y + D.float()[:, None] * x.float()  # the skip connection of each head
        if inference_context is not None:
            inference_context.recurrent_states[self.layer_number] = (conv_state.detach(), ssm_state.detach())
        y = y.to(hidden.dtype).transpose(0, 1).reshape(s, b, -1)  # [s, b, H_l * P]
        gate = z.reshape(s, b, -1)  # heads in the same order: group-major
        y = gated_rms_norm(y, gate, norm_weight, self.norm.group_size, self.norm.eps)
        if self.cp > 1:  # back to this rank's tokens, every local head: [s/cp, b, H_l * P]
            y = to_sequence_sharded(y.view(s, b, groups, -1), self.cp, self.cp_group).flatten(2)
        return self.out_proj(y)

    def _cp_share(self, groups: int) -> tuple[torch.Tensor, ...]:
        """The per-channel and per-head parameters of the ``groups`` groups this rank computes: all
        local ones, or under cp the cp rank's share (its gradient fills that share; the cp
        reduction of gradients sums the shares)."""
        params = (self.conv_weight, self.conv_bias, self.A_log, self.dt_bias, self.D, self.norm.weight)
        if groups == self.local_groups:
            return params
        start = self.cp_rank * groups
        return tuple(p.view(self.local_groups, -1, *p.shape[1:])[start:start + groups].flatten(0, 1) for p in params)

    def _cached_states(self, inference_context) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (conv, ssm) states this layer left in the context, or None at a sequence's start."""
        if inference_context is None or inference_context.sequence_offset == 0:
            return None
        return inference_context.recurrent_states[self.layer_number]

    def _scan(self, x, dt, A, B, C, state):
        """One token after a state: the recurrence's step (no scan); else the chunked scan."""
        if state is not None and x.shape[1] == 1:
            y, state = ssd_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state)
            return y.unsqueeze(1), state
        return ssd_scan(x, dt, A, B, C, chunk_size=self.chunk_size, initial_state=state)
