"""Expert tensors in the layout-independent global layout: a rank at ep_rank 1 of 2 and tp_rank
1 of 2 holds experts 2..3 and the second half of each expert's ffn (SwiGLU gate and up halves
each), at the global offsets the checkpoint and the converters use."""

from types import SimpleNamespace

import torch

from mtl.models.moe import GroupedExperts
from mtl.models.param_layout import load_global_state, parameter_entries


def test_expert_boxes_at_ep2_tp2():
    topology = SimpleNamespace(tp=2, tp_rank=1, ep=2, ep_rank=1, tp_group=None)
    experts = GroupedExperts(num_experts=4, hidden_size=8, ffn_hidden_size=16, activation="swiglu",
                             init_std=0.02, output_init_std=0.02, topology=topology)
    assert experts.linear_fc1.weight.shape == (2, 16, 8) and experts.linear_fc2.weight.shape == (2, 8, 8)
    entries = {e.name: e for e in parameter_entries(experts, topology)}
    fc1, fc2 = entries["linear_fc1.weight"], entries["linear_fc2.weight"]
    assert (fc1.global_shape, fc1.global_offset) == ((4, 2, 16, 8), (2, 0, 8, 0))  # [E, gate|up, ffn, h]
    assert (fc2.global_shape, fc2.global_offset) == ((4, 8, 16), (2, 0, 8))  # [E, h, ffn]

    full_fc1 = torch.arange(4 * 2 * 16 * 8, dtype=torch.float32).view(4, 2, 16, 8)
    full_fc2 = torch.arange(4 * 8 * 16, dtype=torch.float32).view(4, 8, 16)
    load_global_state(experts, topology, {"linear_fc1.weight": full_fc1, "linear_fc2.weight": full_fc2})
    # the local fc1 of each expert is [gate_local; up_local], as the dense MLP's
    assert torch.equal(experts.linear_fc1.weight, torch.cat([full_fc1[2:, 0, 8:], full_fc1[2:, 1, 8:]], dim=1))
    assert torch.equal(experts.linear_fc2.weight, full_fc2[2:, :, 8:])
