"""A hybrid model at cp=2 (the Mamba-2 mixers by all-to-all around the conv and scan, attention by
the ring) equals one process: each rank's per-token losses are its chunks of the whole sequence's,
and the gradients summed over the cp group are the one-process gradients, within 1e-5."""

import torch
import torch.distributed as dist

from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.param_layout import gather_global_state
from mtl.parallel.context_parallel import split_for_context_parallel
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

TOL = 1e-5


def loss_and_grads(config):
    topology = Topology.build(cp=config.parallel.cp)
    model = build_model(registry("model family").get("hybrid"), config, topology, registry("backend").get("local"))
    generator = torch.Generator().manual_seed(5)
    ids, labels = (torch.randint(0, 100, (2, 16), generator=generator) for _ in range(2))
    positions = torch.arange(16).expand(2, 16)
    ids, labels, positions = (split_for_context_parallel(t, 1, topology) for t in (ids, labels, positions))
    loss = model(ids, position_ids=positions, labels=labels)  # [b, s/cp]
    loss.sum().backward()
    grads = gather_global_state(model, topology, grads=True)
    if topology.cp_group is not None:  # what the data/context-parallel gradient reduction does
        for grad in grads.values():
            dist.all_reduce(grad, group=topology.cp_group)
    return loss.detach(), grads


def cp_worker(config):
    torch.set_num_threads(1)
    return loss_and_grads(config)


def test_cp2_equals_one_process(make_hybrid_config):
    ref_loss, ref_grads = loss_and_grads(make_hybrid_config())
    results = run_distributed(cp_worker, 2, (make_hybrid_config(2, parallel={"cp": 2}),))
    for rank, (loss, grads) in enumerate(results):
        chunks = ref_loss.view(2, 4, 4)  # [b, 2cp chunks, s / 2cp]
        expected = torch.cat([chunks[:, rank], chunks[:, 3 - rank]], dim=1)
        torch.testing.assert_close(loss, expected, rtol=TOL, atol=TOL)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=TOL, atol=TOL, msg=f"rank {rank} {name}")
