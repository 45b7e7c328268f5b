"""tp=2 (with and without sequence parallelism) equals tp=1: initial weights bit for bit,
loss and gathered gradients within 1e-5."""

import torch

from mtl.core.plugins import registry
from mtl.models.gpt import build_gpt
from mtl.models.initialization import initialize_parameters
from mtl.models.param_layout import gather_global_state
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

SEED = 11
TOL = 1e-5


def batch():
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 100, (2, 16), generator=generator)
    labels = torch.randint(0, 100, (2, 16), generator=generator)
    return ids, labels


def loss_and_grads(config):
    topology = Topology.build(tp=config.parallel.tp)
    model = build_gpt(config, topology, registry("backend").get("local"))
    initialize_parameters(model, SEED, topology)
    initial = gather_global_state(model, topology)
    ids, labels = batch()
    loss = model(ids, labels=labels)  # [b, s]
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model.parameters(), topology.tp_group)  # what DataParallel does
    return loss.detach(), initial, gather_global_state(model, topology, grads=True)


def tp_worker(configs):
    torch.set_num_threads(1)
    return {run: loss_and_grads(config) for run, config in configs.items()}


def config_for(make_config, style: str, tp: int, sequence_parallel: bool):
    # vocab 100: padded to 128 rows at tp=1 and 256 at tp=2, invisible in both
    return make_config(style, world_size=tp, parallel={"tp": tp, "sequence_parallel": sequence_parallel})


def test_tp2_and_sequence_parallel_equal_tp1(make_config):
    """GPT-2 style (learned positions, biases, tied embedding) and Llama style (GQA, QK-norm,
    SwiGLU, untied head), each without and with sequence parallelism, in one launch."""
    runs = [(style, sp) for style in ("gpt2", "llama") for sp in (False, True)]
    configs = {(style, sp): config_for(make_config, style, 2, sp) for style, sp in runs}
    assert configs[("llama", True)].parallel.sequence_parallel
    rank0, rank1 = run_distributed(tp_worker, 2, (configs,))
    for style, sp in runs:
        ref_loss, ref_init, ref_grads = loss_and_grads(config_for(make_config, style, 1, False))
        for rank_result in (rank0, rank1):
            loss, init, grads = rank_result[(style, sp)]
            assert loss.shape == (2, 16) and loss.dtype == torch.float32
            torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL)
            assert init.keys() == ref_init.keys()
            for name in ref_init:
                assert torch.equal(init[name], ref_init[name]), (style, sp, name)
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=TOL, atol=TOL, msg=f"{style} sp={sp} {name}")
