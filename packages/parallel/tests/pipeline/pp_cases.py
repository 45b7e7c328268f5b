"""Per-rank worker for the pipeline tests: runs a table of cases in one process group (the
machine has 2 cores, so one spawn per world size) and returns what each rank saw."""

from __future__ import annotations

import contextlib

import pp_toy
import torch
import torch.distributed as dist

from mtl.parallel.pipeline import allreduce_shared_embedding_grads, forward_backward, stage_layer_range
from mtl.parallel.pipeline import p2p
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import param_layout

WORLD2_CASES = [
    dict(name="1f1b", pp=2, num_layers=4, micro_batches=4),
    dict(name="1f1b_uneven_split", pp=2, num_layers=5, micro_batches=3, first_stage_layers=2),
    dict(name="1f1b_one_micro_batch", pp=2, num_layers=4, micro_batches=1),
    dict(name="1f1b_no_sync", pp=2, num_layers=4, micro_batches=4, no_sync="single"),
    dict(name="1f1b_forward_only", pp=2, num_layers=4, micro_batches=4, forward_only=True),
    dict(name="interleaved", pp=2, vpp=2, num_layers=4, micro_batches=4, no_sync="per_chunk"),
    dict(name="interleaved_6", pp=2, vpp=2, num_layers=8, micro_batches=6, no_sync="single"),
    # the last virtual stage one layer short, as the LM head's stage is when balanced
    dict(name="interleaved_uneven_split", pp=2, vpp=2, num_layers=7, micro_batches=4,
         virtual_stage_layers=[2, 2, 2, 1]),
    dict(name="interleaved_all_warmup", pp=2, vpp=2, num_layers=4, micro_batches=2),
    dict(name="interleaved_forward_only", pp=2, vpp=2, num_layers=4, micro_batches=4, forward_only=True),
    dict(name="tied_1f1b", pp=2, num_layers=4, micro_batches=4, tied=True),
    dict(name="tied_interleaved", pp=2, vpp=2, num_layers=4, micro_batches=4, tied=True),
]
WORLD4_CASES = [
    dict(name="pp4_1f1b", pp=4, num_layers=4, micro_batches=4),
    dict(name="pp4_1f1b_6", pp=4, num_layers=8, micro_batches=6, no_sync="single"),
    dict(name="pp4_forward_only", pp=4, num_layers=4, micro_batches=4, forward_only=True),
    dict(name="pp4_interleaved", pp=4, vpp=2, num_layers=8, micro_batches=8, no_sync="per_chunk"),
    dict(name="pp2_dp2_1f1b", pp=2, num_layers=4, micro_batches=4, tied=True),
]
CASES = {2: WORLD2_CASES, 4: WORLD4_CASES}


class SyncRecorder:
    """A stand-in for a data-parallel wrapper: ``no_sync()`` switches ``syncing`` off, and a
    gradient hook on each parameter logs whether its gradient was computed while syncing."""

    def __init__(self):
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


def run_case(case: dict, device: torch.device = torch.device("cpu")) -> dict:
    pp, vpp = case["pp"], case.get("vpp", 1)
    num_layers, num_micro_batches = case["num_layers"], case["micro_batches"]
    topology = Topology.build(pp=pp, vpp=vpp)
    full = pp_toy.ToyModel(num_layers, tied=case.get("tied", False))
    chunks = []
    for chunk in range(vpp):
        start, end = stage_layer_range(num_layers, topology, chunk, case.get("first_stage_layers"),
                                       virtual_stage_layers=case.get("virtual_stage_layers"))
        virtual_stage = chunk * pp + topology.pp_rank
        chunk_model = pp_toy.ToyChunk(full, start, end, virtual_stage == 0, virtual_stage == pp * vpp - 1)
        chunks.append(chunk_model.to(device))

    no_sync = case.get("no_sync")
    recorders = [SyncRecorder() for _ in chunks]
    if no_sync == "single":  # one context for the whole rank: every chunk sees the same one
        recorders = [recorders[0]] * len(chunks)
    events: dict[str, list[bool]] = {}
    for chunk, recorder in zip(chunks, recorders):
        for name, param in chunk.params.items():
            events[name] = []
            param.register_hook(lambda grad, name=name, recorder=recorder: events[name].append(recorder.syncing))
    no_sync_func = {
        None: None,
        "single": recorders[0].no_sync,
        "per_chunk": [r.no_sync for r in recorders],
    }[no_sync]

    batches = [{k: v.to(device) for k, v in b.items()} for b in pp_toy.make_micro_batches(num_micro_batches)]
    metrics = forward_backward(
        pp_toy.forward_step,
        [iter(batches) for _ in chunks],
        chunks,
        num_micro_batches,
        pp_toy.TENSOR_SHAPE,
        torch.float32,
        topology,
        forward_only=case.get("forward_only", False),
        no_sync_func=no_sync_func,
    )
    params = {name: p for chunk in chunks for name, p in chunk.params.items()}
    before_sync = {n: p.grad.to("cpu", copy=True) for n, p in params.items() if param_layout(p).shared_embedding}
    allreduce_shared_embedding_grads(chunks, topology)
    return dict(
        pp_rank=topology.pp_rank,
        losses=[m["loss"].item() for m in metrics],
        grads={n: None if p.grad is None else p.grad.to("cpu", copy=True) for n, p in params.items()},
        shared_before_sync=before_sync,
        sync_events=events,
    )


def exchange_both_ways(device: torch.device = torch.device("cpu")) -> dict:
    """pp = 2: each rank sends an activation and a gradient to its only peer in one batch."""
    topology = Topology.build(pp=2)
    p2p.ensure_pp_group_ready(topology)
    me = topology.pp_rank
    activation = torch.full(pp_toy.TENSOR_SHAPE, 10.0 + me, device=device)
    gradient = torch.full(pp_toy.TENSOR_SHAPE, 20.0 + me, device=device)
    from_prev, from_next = p2p.communicate(
        topology,
        send_next=activation,
        send_prev=gradient,
        recv_prev=True,
        recv_next=True,
        tensor_shape=pp_toy.TENSOR_SHAPE,
        dtype=torch.float32,
        device=device,
    )
    return dict(pp_rank=me, from_prev=from_prev.detach()[0, 0, 0].item(), from_next=from_next[0, 0, 0].item())


def worker(world_size: int) -> dict:
    results = {case["name"]: run_case(case) for case in CASES[world_size]}
    if world_size == 2:
        results["exchange"] = exchange_both_ways()
    dist.barrier()
    return results
