"""A hybrid model (Mamba-2, attention, MLP and MoE layers) at tp=2, with and without sequence parallelism,
equals one process: initial global weights bit for bit, loss and gathered gradients within 1e-5."""

import torch

from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.param_layout import gather_global_state
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

TOL = 1e-5


def loss_and_grads(config):
    topology = Topology.build(tp=config.parallel.tp)
    model = build_model(registry("model family").get("hybrid"), config, topology, registry("backend").get("local"))
    initial = gather_global_state(model, topology)
    generator = torch.Generator().manual_seed(5)
    ids, labels = (torch.randint(0, 100, (2, 16), generator=generator) for _ in range(2))
    loss = model(ids, labels=labels)  # [b, s]
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model.parameters(), topology.tp_group)  # what DataParallel does
    return loss.detach(), initial, gather_global_state(model, topology, grads=True)


def tp_worker(configs):
    torch.set_num_threads(1)
    return {run: loss_and_grads(config) for run, config in configs.items()}


MOE = {"hybrid_pattern": "M*E-", "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16}
NEMOTRON_H_STYLE = {"activation": "relu2", "position_embedding": "none", "mamba_dt_min": 0.01}
# Nemotron-H's MoE layer: squared-ReLU experts, a shared expert, biased sigmoid routing in 2 groups, scaled
NEMOTRON_H_MOE = {**NEMOTRON_H_STYLE, **MOE, "moe_shared_expert_ffn_hidden_size": 16, "moe_router": "sigmoid",
                  "moe_router_expert_bias": True, "moe_router_scaling_factor": 2.0, "moe_router_num_groups": 2}


def test_tp2_and_sequence_parallel_equal_one_process(make_hybrid_config):
    """M*M- without and with sequence parallelism, M*E- (an MoE layer) and Nemotron-H's style (squared-ReLU
    MLP, attention without positions, a dt floor; its MoE layer) with it, in one launch."""
    runs = {"sp=False": ({}, False), "sp=True": ({}, True), "moe sp=True": (MOE, True),
            "nemotron-h style sp=True": (NEMOTRON_H_STYLE, True), "nemotron-h moe sp=True": (NEMOTRON_H_MOE, True)}
    configs = {run: make_hybrid_config(2, model=model, parallel={"tp": 2, "sequence_parallel": sp})
               for run, (model, sp) in runs.items()}
    references = {run: loss_and_grads(make_hybrid_config(model=model)) for run, (model, _) in runs.items()}
    assert any(name.endswith("mixer.in_proj.weight") for name in references["sp=False"][1])
    for rank_result in run_distributed(tp_worker, 2, (configs,)):
        for run, (loss, init, grads) in rank_result.items():
            ref_loss, ref_init, ref_grads = references[run]
            torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL)
            assert init.keys() == ref_init.keys()
            for name in ref_init:
                assert torch.equal(init[name], ref_init[name]), (run, name)
            assert grads.keys() == ref_grads.keys()  # the router's expert bias has none
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=TOL, atol=TOL, msg=f"{run} {name}")


def test_full_recompute_gives_the_same_loss_and_gradients(make_hybrid_config):
    ref_loss, _, ref_grads = loss_and_grads(make_hybrid_config())
    loss, _, grads = loss_and_grads(make_hybrid_config(train={"recompute": "full"}))
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=TOL, atol=TOL, msg=name)
