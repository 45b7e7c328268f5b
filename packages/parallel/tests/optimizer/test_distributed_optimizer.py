"""The ZeRO-1 distributed optimizer at dp=2 follows single-process torch AdamW.

Every step: 2 micro-batches per rank (first in ``no_sync``), gradients clipped to a global
norm that is actually hit, then AdamW with decayed / not-decayed groups. Parameters must equal
a single-process ``torch.optim.AdamW`` run on the full batch within 1e-6 after each of 3
steps; each rank keeps about half of the optimizer state; resuming after step 2 from
``state_dict()`` or from ``state_pieces()`` reproduces step 3 exactly, and the moments
``full_moments()`` gathers resume the replicated optimizer in one process.
"""

import copy

import pytest
import torch
from torch import nn

from mtl.core.errors import CheckpointError, ConfigError, ParallelError
from mtl.parallel.ddp import DataParallel
from mtl.parallel.ddp.grad_buffer import SHARD_ALIGNMENT
from mtl.parallel.optimizer import DistributedOptimizer, ReplicatedOptimizer, build_optimizer
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

TOL = dict(rtol=1e-6, atol=1e-6)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05  # below the gradient norms of this model and data, so clipping acts
TINY_BUCKET_MB = 100 * 4 / 2**20


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def make_batch(step: int):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def reference_params_per_step(num_steps: int) -> list[list[torch.Tensor]]:
    """Single process: torch AdamW, groups built by hand (decay matrices only)."""
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith("bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])
    history = []
    for step in range(num_steps):
        opt.zero_grad()
        x, y = make_batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def train_step(model, opt, step: int, dp_rank: int, dp: int) -> float:
    opt.zero_grad()
    x, y = make_batch(step)
    per_rank = x.shape[0] // dp
    xs, ys = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    micro = list(zip(xs.chunk(2), ys.chunk(2)))
    with model.no_sync():
        (nn.functional.mse_loss(model(micro[0][0]), micro[0][1]) / 2).backward()
    (nn.functional.mse_loss(model(micro[1][0]), micro[1][1]) / 2).backward()
    model.finish_grad_sync()
    norm = opt.clip_grad_norm(MAX_NORM)
    opt.step()
    return norm


def build(topo, seed: int = 0):
    model = DataParallel(make_model(seed), topo, bucket_size_mb=TINY_BUCKET_MB, use_distributed_optimizer=True)
    return model, build_optimizer(model, topo, use_distributed_optimizer=True, **ADAMW)


def dp2_distributed_adamw():
    topo = Topology.build()
    reference = reference_params_per_step(3)
    model, opt = build(topo)
    assert isinstance(opt, DistributedOptimizer)
    snapshot = None
    for step in range(3):
        if step == 2:  # what a checkpoint after step 2 holds
            snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                        [(p.first, {m: t.clone() for m, t in p.moments.items()}) for p in opt.state_pieces()],
                        opt.common_state())
            index = {id(p): i for i, p in enumerate(model.module.parameters())}
            full = {index[id(param)]: {m: t.clone() for m, t in moments.items()}
                    for param, moments in opt.full_moments()}
        train_step(model, opt, step, topo.dp_rank, topo.dp)
        for p, p_ref in zip(model.parameters(), reference[step]):
            torch.testing.assert_close(p, p_ref, **TOL, msg=f"step {step + 1}")
    final = [p.detach().clone() for p in model.parameters()]
    state_numel = sum(s["exp_avg"].numel() for s in opt.inner.state.values())

    model_state, opt_state, pieces, common = snapshot
    # Resume from state_dict(): a fresh model and optimizer, different init, same layout.
    model2, opt2 = build(topo, seed=7)
    model2.load_state_dict(model_state)
    opt2.load_state_dict(opt_state)
    train_step(model2, opt2, 2, topo.dp_rank, topo.dp)
    for p, p_final in zip(model2.parameters(), final):
        torch.testing.assert_close(p, p_final, rtol=0, atol=0, msg="state_dict resume")
    # Resume from state_pieces(): load each live piece in place, then the step count.
    model3, opt3 = build(topo, seed=8)
    model3.load_state_dict(model_state)
    for piece, (first, moments) in zip(opt3.state_pieces(), pieces, strict=True):
        assert piece.first == first
        for name, tensor in piece.moments.items():
            tensor.copy_(moments[name])
    opt3.load_common_state(common)
    train_step(model3, opt3, 2, topo.dp_rank, topo.dp)
    for p, p_final in zip(model3.parameters(), final):
        torch.testing.assert_close(p, p_final, rtol=0, atol=0, msg="state_pieces resume")
    return {"state_numel": state_numel, "num_buckets": len(model.buckets), "full": full,
            "common": common, "params_after_2": [p.clone() for p in model_state.values()]}


def test_dp2_distributed_optimizer_matches_torch_adamw_and_resumes():
    results = run_distributed(dp2_distributed_adamw, world_size=2)
    total = sum(p.numel() for p in make_model().parameters())
    assert sum(r["state_numel"] for r in results) == total
    for r in results:  # about 1/dp each; padding of each bucket can shift a few elements
        assert abs(r["state_numel"] - total / 2) <= r["num_buckets"] * SHARD_ALIGNMENT, r["state_numel"]

    # Both ranks gathered the same whole moments, and they resume the *replicated* optimizer
    # in one process: the checkpoint layout is shared.
    assert results[0]["full"].keys() == results[1]["full"].keys() == set(range(len(list(make_model().parameters()))))
    model = make_model(seed=3)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), results[0]["params_after_2"]):
            p.copy_(saved)
    opt = ReplicatedOptimizer([model], Topology.single(), **ADAMW)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for param, moments in opt.full_moments():
        for name, tensor in moments.items():
            assert torch.equal(results[0]["full"][index[id(param)]][name], results[1]["full"][index[id(param)]][name])
            assert torch.count_nonzero(results[0]["full"][index[id(param)]][name]) > 0, name
            tensor.copy_(results[0]["full"][index[id(param)]][name])
    opt.load_common_state(results[0]["common"])
    assert opt.common_state() == {"step": 2}
    opt.zero_grad()
    x, y = make_batch(2)
    nn.functional.mse_loss(model(x), y).backward()
    opt.clip_grad_norm(MAX_NORM)
    opt.step()
    for p, p_ref in zip(model.parameters(), reference_params_per_step(3)[2]):
        torch.testing.assert_close(p, p_ref, **TOL)


def test_replicated_optimizer_single_process_matches_torch_adamw():
    reference = reference_params_per_step(3)
    model = make_model()
    opt = build_optimizer(model, Topology.single(), use_distributed_optimizer=False, **ADAMW)
    assert [len(g["params"]) for g in opt.param_groups] == [3, 5]  # 3 matrices; 3 biases + LayerNorm weight, bias
    for step in range(3):
        opt.zero_grad()
        x, y = make_batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.clip_grad_norm(MAX_NORM)
        opt.step()
        for p, p_ref in zip(model.parameters(), reference[step]):
            torch.testing.assert_close(p, p_ref, **TOL)
    other = build_optimizer(make_model(), Topology.single(), use_distributed_optimizer=False, **ADAMW)
    other_state = other.state_dict()
    other_state["layout"] = other_state["layout"][:-1]
    with pytest.raises(CheckpointError, match="another layout"):
        opt.load_state_dict(other_state)


def test_bad_settings_are_refused():
    with pytest.raises(ParallelError, match="use_distributed_optimizer=True"):
        build_optimizer(make_model(), Topology.single(), use_distributed_optimizer=True, **ADAMW)
    with pytest.raises(ConfigError, match="train.lr"):
        build_optimizer(make_model(), Topology.single(), use_distributed_optimizer=False,
                        **{**ADAMW, "lr": -1.0})
