"""An MoE GPT at tp=2 (sequence parallel, and plain TP with a capacity factor) gives the
first 3 losses and every gathered gradient of one process within 1e-5 (fp32), aux losses
included: three SGD steps, each rank updating its own shards."""

import torch

from mtl.core.plugins import registry
from mtl.models.gpt import build_gpt
from mtl.models.moe import set_aux_loss_scale
from mtl.models.param_layout import gather_global_state
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

TOL = 1e-5
STEPS = 3
MOE = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_aux_loss_coeff": 0.1,
       "moe_z_loss_coeff": 0.01}
RUNS = {
    "sp_shared_gate": ({**MOE, "moe_shared_expert_ffn_hidden_size": 16, "moe_shared_expert_gate": True}, True),
    "tp_capacity_sigmoid": ({**MOE, "moe_capacity_factor": 1.0, "moe_router": "sigmoid", "moe_layer_freq": 2}, False),
}


def batch():
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 100, (2, 16), generator=generator)
    return ids, torch.roll(ids, -1, 1)


def train_steps(config):
    """Losses [STEPS, b, s] and the gathered gradients of every step."""
    topology = Topology.build(tp=config.parallel.tp)
    model = build_gpt(config, topology, registry("backend").get("local"))
    set_aux_loss_scale(model, 1.0)  # one micro-batch, loss.mean() below
    ids, labels = batch()
    losses, grads = [], []
    for _ in range(STEPS):
        model.zero_grad()
        loss = model(ids, labels=labels)
        loss.mean().backward()
        allreduce_sequence_parallel_grads(model.parameters(), topology.tp_group)  # what DataParallel does
        losses.append(loss.detach())
        grads.append(gather_global_state(model, topology, grads=True))
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.5 * param.grad
    return torch.stack(losses), grads


def tp_worker(configs):
    torch.set_num_threads(1)
    return {run: train_steps(config) for run, config in configs.items()}


def test_moe_tp2_equals_one_process(make_config):
    configs = {run: make_config("llama", world_size=2, model=model, parallel={"tp": 2, "sequence_parallel": sp})
               for run, (model, sp) in RUNS.items()}
    assert configs["sp_shared_gate"].parallel.sequence_parallel
    results = run_distributed(tp_worker, 2, (configs,))
    for run, (model, _) in RUNS.items():
        ref_losses, ref_grads = train_steps(make_config("llama", model=model))
        assert ref_losses[0].mean() > ref_losses[-1].mean()  # the steps do move the model
        for rank_result in results:
            losses, grads = rank_result[run]
            torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL, msg=run)
            for step in range(STEPS):
                assert grads[step].keys() == ref_grads[step].keys()
                for name, ref in ref_grads[step].items():
                    torch.testing.assert_close(grads[step][name], ref, rtol=TOL, atol=TOL,
                                               msg=lambda m, name=name, step=step: f"{run} step {step} {name}: {m}")
