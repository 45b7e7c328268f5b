"""The fused leaves of the backend contract: a backend that supplies ``norm_column_linear``
(and ``norm_mlp``) builds the same tree with the same parameter names as the local backend,
and gives its numbers (bit for bit at tp=1, 1e-5 at tp=2 with sequence parallelism).

The fusing backend here is written the way a third party would, from mtl.parallel's TP
layers and the norm module the layer hands over."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.plugins import registry
from mtl.models.gpt import build_gpt
from mtl.models.param_layout import gather_global_state
from mtl.models.swiglu import swiglu
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads
from mtl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import set_param_layout


class NormColumnLinear(ColumnParallelLinear):
    """column_linear(norm(x)); the norm is held by reference, not as a submodule."""

    def __init__(self, input_size, output_size, *, norm, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.__dict__["norm"] = norm  # outside the module tree: its parameters keep their names

    def forward(self, x):
        return super().forward(self.norm(x))


class NormMLP(nn.Module):
    def __init__(self, *, norm, hidden_size, ffn_hidden_size, activation, bias, init_std, output_init_std,
                 topology, sequence_parallel):
        super().__init__()
        self.__dict__["norm"] = norm
        self.gated = activation == "swiglu"
        self.linear_fc1 = ColumnParallelLinear(
            hidden_size, 2 * ffn_hidden_size if self.gated else ffn_hidden_size, bias=bias, init_std=init_std,
            topology=topology, sequence_parallel=sequence_parallel, stride=2 if self.gated else 1)
        if self.gated:
            for param in self.linear_fc1.parameters():
                set_param_layout(param, tp_stride=2)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=bias, init_std=output_init_std,
                                            topology=topology, sequence_parallel=sequence_parallel)

    def forward(self, x):
        h = self.linear_fc1(self.norm(x))
        if self.gated:
            h = swiglu(h)  # as the local MLP computes it
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)


def fused_backend(with_mlp: bool):
    local = registry("backend").get("local")
    return dataclasses.replace(local, name="fused", norm_column_linear=NormColumnLinear,
                               norm_mlp=NormMLP if with_mlp else None)


def loss_and_grads(config, backend):
    topology = Topology.build(tp=config.parallel.tp)
    model = build_gpt(config, topology, backend)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 100, (2, 16), generator=generator)
    labels = torch.randint(0, 100, (2, 16), generator=generator)
    loss = model(ids, labels=labels)
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model.parameters(), topology.tp_group)  # what DataParallel does
    return model, loss.detach(), gather_global_state(model, topology, grads=True)


def test_fused_leaves_keep_names_and_numbers(make_config):
    for style in ("gpt2", "llama"):
        config = make_config(style)
        local_model, ref_loss, ref_grads = loss_and_grads(config, registry("backend").get("local"))
        for with_mlp in (False, True):
            model, loss, grads = loss_and_grads(config, fused_backend(with_mlp))
            assert [n for n, _ in model.named_parameters()] == [n for n, _ in local_model.named_parameters()]
            layer = model.layers["0"]
            assert layer.fuse_input_norm and layer.fuse_pre_mlp_norm
            assert isinstance(layer.self_attention.linear_qkv, NormColumnLinear)
            assert isinstance(layer.mlp, NormMLP if with_mlp else nn.Module)
            assert torch.equal(loss, ref_loss), (style, with_mlp)
            for name, grad in ref_grads.items():
                assert torch.equal(grads[name], grad), (style, with_mlp, name)


def _tp_worker(configs):
    torch.set_num_threads(1)
    return {style: loss_and_grads(config, fused_backend(True))[1:] for style, config in configs.items()}


def test_fused_leaves_under_tp2_sequence_parallel(make_config):
    """Under SP the fused leaves use the layer's norm parameters, so the norm gradients are
    marked for the per-step sum over TP as the unfused norm's are."""
    configs = {style: make_config(style, world_size=2, parallel={"tp": 2, "sequence_parallel": True})
               for style in ("gpt2", "llama")}
    results = run_distributed(_tp_worker, 2, (configs,))
    for style in configs:
        _, ref_loss, ref_grads = loss_and_grads(make_config(style), registry("backend").get("local"))
        for rank_result in results:
            loss, grads = rank_result[style]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{style} {name}")
