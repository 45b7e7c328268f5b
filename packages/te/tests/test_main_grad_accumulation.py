"""Transformer Engine's weight-gradient GEMMs accumulate into mtl's fp32 ``main_grad``
(``fuse_wgrad_accumulation``, switched on by mtl.parallel's ``enable_wgrad_fusion``).

bf16 weights in DataParallel with fp32 gradient buffers, two micro-batches through a fused
norm + column linear, a TE row linear and a fused norm + MLP: the fused leaves' ``main_grad``
(the bf16 row linear keeps the hook's path, see ``_PlainLinearAccumulation``) equals the hook's (per-micro-batch bf16 gradients added in fp32) within bf16 rounding, every
bucket still launches (TE's placeholder gradient fires the hooks), and the norm weights
(shared with the layer's norm module) keep the hook's path. GPU and Transformer Engine only."""

import pytest
import torch
from torch import nn

from mtl.te.availability import te_import_error

pytestmark = pytest.mark.skipif(
    te_import_error() is not None or not torch.cuda.is_available(),
    reason=f"needs a GPU and Transformer Engine ({te_import_error() or 'no GPU'})",
)


class Block(nn.Module):
    def __init__(self):
        from mtl.te import factories

        super().__init__()
        self.input_norm = factories.norm(64, kind="rmsnorm", eps=1e-5)
        self.qkv = factories.norm_column_linear(64, 192, norm=self.input_norm, bias=False, init_std=0.02,
                                                topology=None)
        self.proj = factories.row_linear(192, 64, bias=False, init_std=0.02, topology=None)
        self.pre_mlp_norm = factories.norm(64, kind="rmsnorm", eps=1e-5)
        self.mlp = factories.norm_mlp(norm=self.pre_mlp_norm, hidden_size=64, ffn_hidden_size=128,
                                      activation="swiglu", bias=False, init_std=0.02, output_init_std=0.02,
                                      topology=None, sequence_parallel=False)

    def forward(self, x):
        h = x + self.proj(self.qkv(x))
        return h + self.mlp(h)


def run(fused: bool, dtype=torch.bfloat16):
    from mtl.parallel.ddp import DataParallel
    from mtl.parallel.tensor_parallel.wgrad_fusion import enable_wgrad_fusion
    from mtl.parallel.topology import Topology

    torch.manual_seed(0)
    block = Block()
    for p in block.parameters():
        p.data = p.data.to(dtype)
    if fused:
        # qkv, proj, fc1, fc2; the norms' weights are also held by their norm modules
        # the fused leaves' three weights; the bf16 te.Linear (proj) compiles instead (modules.py)
        assert enable_wgrad_fusion(block) == 3
    model = DataParallel(block, Topology.single(), grad_dtype=torch.float32, bucket_size_mb=1e-4,
                         overlap_grad_reduce=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randn(32, 2, 64, device="cuda", generator=g).to(dtype) for _ in range(2)]
    model.zero_grad()
    with model.no_sync():
        block(batches[0]).float().square().sum().backward()
    block(batches[1]).float().square().sum().backward()
    assert all(b.launched for b in model.buckets)
    model.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in block.named_parameters()}, block


def test_te_weights_accumulate_into_main_grad():
    fused, block = run(True)
    assert block.qkv.fuse_wgrad_accumulation and block.mlp.fused.fuse_wgrad_accumulation
    assert not block.proj.fuse_wgrad_accumulation and not getattr(block.proj.weight, "wgrad_fused", False)
    assert not getattr(block.input_norm.weight, "wgrad_fused", False)
    hooked, _ = run(False)
    for name in fused:
        scale = hooked[name].abs().max().item()
        torch.testing.assert_close(fused[name], hooked[name], rtol=2e-2, atol=2e-2 * scale, msg=name)
    for name in ("input_norm.weight", "pre_mlp_norm.weight"):  # the hook's path in both runs
        torch.testing.assert_close(fused[name], hooked[name], rtol=1e-3, atol=1e-3 * hooked[name].abs().max().item())
