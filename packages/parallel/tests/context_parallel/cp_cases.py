"""Shared by the context-parallel tests: the attention cases, their inputs, the reference, and
the per-rank worker that ``run_distributed`` starts (a plain module so spawned processes can
import it by name)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from mtl.core.errors import ParallelError
from mtl.parallel.context_parallel import (
    context_parallel_attention,
    context_parallel_position_ids,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from mtl.parallel.topology import Topology

BATCH, SEQ, HEAD_DIM = 2, 16, 8
# bfloat16: the result itself is rounded to 8 mantissa bits (relative step 2**-8 ~ 4e-3).
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}
# Hand-written load-balanced layouts for s = 16: rank r holds chunks r and 2cp-1-r.
EXPECTED_POSITIONS = {
    2: [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]],
    4: [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    causal: bool
    heads: int
    groups: int
    softmax_scale: float | None = None

    @property
    def name(self) -> str:
        kind = "causal" if self.causal else "full"
        scale = "" if self.softmax_scale is None else f"-scale{self.softmax_scale}"
        return f"{str(self.dtype).removeprefix('torch.')}-{kind}-h{self.heads}g{self.groups}{scale}"


CASES = [
    Case(torch.float32, True, 4, 4),
    Case(torch.float32, False, 4, 4),
    Case(torch.float32, True, 4, 2),  # grouped-query attention
    Case(torch.float32, False, 4, 2),
    Case(torch.float32, True, 4, 1, softmax_scale=0.5),
    Case(torch.float64, True, 4, 2),
    Case(torch.float64, False, 4, 2),
    Case(torch.bfloat16, True, 4, 2),  # half-precision inputs, float32 accumulation
]


class RingOfOne:
    """A ``CpRing`` of one rank, without processes: its single step is the diagonal block, and
    its backward starts and ends on the rank's own block, so nothing is ever exchanged."""

    size, rank = 1, 0

    def exchange(self, send, recv, tag, backward=False):
        raise AssertionError("a ring of one rank exchanged a block")


def make_inputs(case: Case, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Full-sequence q ``[b, s, heads, d]``, k/v ``[b, s, groups, d]`` and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (BATCH, SEQ, case.heads, HEAD_DIM),
        "k": (BATCH, SEQ, case.groups, HEAD_DIM),
        "v": (BATCH, SEQ, case.groups, HEAD_DIM),
        "dout": (BATCH, SEQ, case.heads, HEAD_DIM),
    }
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64).to(case.dtype) for name, shape in shapes.items()}


def reference_attention(case: Case, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output and q/k/v gradients of plain full-sequence attention in float64, in one process."""
    q, k, v = (inputs[n].double().requires_grad_() for n in ("q", "k", "v"))
    repeats = case.heads // case.groups
    k_heads, v_heads = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    scale = case.softmax_scale if case.softmax_scale is not None else HEAD_DIM**-0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_heads) * scale
    if case.causal:
        future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v_heads)
    out.backward(inputs["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def assert_case_matches_reference(case: Case, layouts: list[tuple], per_rank: list[dict]) -> None:
    """Every rank's gathered output and gradients equal the float64 one-process reference."""
    reference = reference_attention(case, make_inputs(case))
    tol = TOLERANCE[case.dtype]
    for layout in layouts:
        for rank, results in enumerate(per_rank):
            got = results[layout]["cases"][case.name]
            for name, expected in reference.items():
                assert got[name].dtype == case.dtype, (layout, rank, name)
                torch.testing.assert_close(
                    got[name].double(), expected, atol=tol, rtol=tol,
                    msg=lambda m, where=(layout, rank, name): f"(tp, cp[, comm]), rank, tensor = {where}: {m}",
                )


def assert_sharding_and_refusals(layouts: list[tuple], per_rank: list[dict]) -> None:
    """Split/gather round trip, local shape, position ids and the dropout refusal on every rank."""
    full = torch.arange(2 * 3 * SEQ, dtype=torch.float32).reshape(2, SEQ, 3)
    for key in layouts:
        cp = key[1]
        for results in per_rank:
            layout = results[key]
            assert layout["local_shape"] == (2, SEQ // cp, 3)
            assert torch.equal(layout["round_trip"], full)
            assert layout["position_ids"].tolist() == EXPECTED_POSITIONS[cp][layout["cp_rank"]]
            message = layout["dropout_error"]
            assert message is not None and "model.attention_dropout = 0" in message


def _run_case(case: Case, topology: Topology, device: str) -> dict[str, torch.Tensor]:
    inputs = {name: t.to(device) for name, t in make_inputs(case).items()}
    q, k, v = (split_for_context_parallel(inputs[n], 1, topology).requires_grad_() for n in ("q", "k", "v"))
    out = context_parallel_attention(
        q, k, v, topology=topology, causal=case.causal, softmax_scale=case.softmax_scale
    )
    out.backward(split_for_context_parallel(inputs["dout"], 1, topology))
    gathered = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: gather_from_context_parallel(t, 1, topology).cpu() for name, t in gathered.items()}


def worker(layouts: list[tuple], device: str = "cpu") -> dict:
    """On every rank: for each (tp, cp[, cp_comm_type]) layout (default "p2p", the ring), every
    case gathered to full order, plus the sharding checks and the dropout refusal. Returns
    everything for the parent to compare, by layout."""
    results: dict = {}
    for key in layouts:
        tp, cp, *comm = key
        topology = Topology.build(tp=tp, cp=cp, cp_comm_type=comm[0] if comm else "p2p")
        layout = {"cp_rank": topology.cp_rank, "cases": {}}
        for case in CASES:
            layout["cases"][case.name] = _run_case(case, topology, device)
        full = torch.arange(2 * 3 * SEQ, dtype=torch.float32, device=device).reshape(2, SEQ, 3)
        local = split_for_context_parallel(full, 1, topology)
        layout["local_shape"] = tuple(local.shape)
        layout["round_trip"] = gather_from_context_parallel(local, -2, topology).cpu()
        layout["position_ids"] = context_parallel_position_ids(SEQ, topology, device).cpu()
        try:
            q = torch.zeros(1, SEQ // cp, 2, 4, device=device)
            context_parallel_attention(q, q, q, topology=topology, dropout_p=0.1)
            layout["dropout_error"] = None
        except ParallelError as err:
            layout["dropout_error"] = str(err)
        results[key] = layout
        dist.barrier()
    return results


def nccl_rank(rank: int, world_size: int, port: int, out_dir: str, layouts: list[tuple[int, int]]) -> None:
    """One GPU rank of the NCCL variant: ``worker`` on ``cuda:rank``, results saved to ``out_dir``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    try:
        torch.save(worker(layouts, str(device)), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()

