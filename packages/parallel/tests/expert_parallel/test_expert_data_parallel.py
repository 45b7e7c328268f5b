"""Expert parameters under data parallelism, on 4 gloo processes: dp=4, ep=2 (two ranks hold
experts 0-1, two hold experts 2-3), then cp=2 x dp=2, ep=2 (the cp peers hold the same
experts and see other tokens: expert gradients are summed over them too).

A toy MoE (a dense linear, then per-token experts reached through the all-to-all) trains 3
AdamW steps with clipping, once with the replicated and once with the distributed optimizer.
Every step must equal one process training the whole model on the concatenated batch:
gradients after the reduction (dense over dp, experts over the ranks holding them, scaled to
the global mean), the clipping norm, the updated parameters, and the optimizer's moments of
each expert. Ranks start from different expert weights on purpose: only the broadcast over
the ranks holding the *same* experts makes them agree with the reference.
"""

import torch
from torch import nn

from mtl.parallel.ddp import DataParallel
from mtl.parallel.expert_parallel import TokenExchange
from mtl.parallel.optimizer import build_optimizer
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import set_param_layout

HIDDEN, NUM_EXPERTS, TOKENS, STEPS = 4, 4, 6, 3
ADAMW = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=1e-5, atol=1e-6)


class ToyMoE(nn.Module):
    """``z = y + expert_e(y)``, ``y = dense(x)``; token t goes to expert ``route[t]``; this
    rank holds experts ``[first, first + num_local)`` of ``NUM_EXPERTS``."""

    def __init__(self, full: dict[str, torch.Tensor], first: int, num_local: int, ep_group=None):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.dense.weight.data.copy_(full["dense.weight"])
        self.expert_weight = nn.Parameter(full["expert_weight"][first : first + num_local].clone())
        self.expert_bias = nn.Parameter(full["expert_bias"][first : first + num_local].clone())
        for p in (self.expert_weight, self.expert_bias):
            set_param_layout(p, expert_split_dim=0)
        self.num_local, self.ep_group = num_local, ep_group

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        order = torch.argsort(route, stable=True)  # tokens grouped by expert, so by ep rank
        exchange = TokenExchange(torch.bincount(route, minlength=NUM_EXPERTS), self.ep_group)
        tokens = exchange.dispatch(y[order])  # [M, h] sorted by local expert
        local_expert = torch.repeat_interleave(torch.arange(self.num_local), exchange.tokens_per_local_expert)
        out = torch.einsum("nh,nhk->nk", tokens, self.expert_weight[local_expert]) + self.expert_bias[local_expert]
        back = exchange.combine(out)
        return y + torch.empty_like(back).index_copy(0, order, back)  # back to token order


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"dense.weight": torch.randn(HIDDEN, HIDDEN, generator=g) / 2,
            "expert_weight": torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=g) / 2,
            "expert_bias": torch.randn(NUM_EXPERTS, HIDDEN, generator=g)}


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randint(0, NUM_EXPERTS, (TOKENS,), generator=g)


def loss_of(model, x, route):
    return model(x, route).square().mean()


def reference(num_batches: int) -> list[dict]:
    """One process, all experts: per step the gradients, the norm, the updated parameters and
    the final moments, for the loss averaged over the dp x cp ranks' batches."""
    model = ToyMoE(full_weights(), 0, NUM_EXPERTS)
    decay = [model.dense.weight, model.expert_weight]
    opt = torch.optim.AdamW([{"params": decay}, {"params": [model.expert_bias], "weight_decay": 0.0}], **ADAMW)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        (sum(loss_of(model, *batch(step, r)) for r in range(num_batches)) / num_batches).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5 if step else float("inf")))
        opt.step()
        steps.append({"grads": grads, "norm": norm, "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    steps[-1]["moments"] = {n: {m: opt.state[p][m].clone() for m in ("exp_avg", "exp_avg_sq")}
                            for n, p in model.named_parameters()}
    return steps


def train_and_compare(topo: Topology, distributed: bool, ref: list[dict]) -> None:
    num_local = NUM_EXPERTS // topo.ep
    first = topo.ep_rank * num_local
    full = full_weights()
    if topo.expert_dp_rank != 0 or topo.cp_rank != 0:  # wrong on purpose: the broadcast must fix it
        full = {n: t + 1.0 for n, t in full.items()}
    model = DataParallel(ToyMoE(full, first, num_local, topo.group("ep")), topo, bucket_size_mb=1e-4,
                         use_distributed_optimizer=distributed)
    opt = build_optimizer(model, topo, use_distributed_optimizer=distributed, **ADAMW)
    mine = lambda name, t: t[first : first + num_local] if name.startswith("expert") else t  # noqa: E731
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, *batch(step, topo.dp_rank * topo.cp + topo.cp_rank)).backward()
        model.finish_grad_sync()
        for name, p in model.module.named_parameters():
            expected = mine(name, ref[step]["grads"][name]).reshape(-1)
            lo, hi = getattr(p, "dp_owned_grad_range", (0, p.numel())) if distributed else (0, p.numel())
            torch.testing.assert_close(p.grad.reshape(-1)[lo:hi], expected[lo:hi], **TOL,
                                       msg=lambda m, name=name: f"step {step} grad {name}: {m}")
        norm = opt.clip_grad_norm(0.5 if step else float("inf"))
        assert abs(norm - ref[step]["norm"]) <= 1e-5 * ref[step]["norm"], (step, norm, ref[step]["norm"])
        opt.step()
        for name, p in model.module.named_parameters():
            torch.testing.assert_close(p.detach(), mine(name, ref[step]["params"][name]), **TOL,
                                       msg=lambda m, name=name: f"step {step} param {name}: {m}")
    names = {id(p): n for n, p in model.module.named_parameters()}
    for param, moments in opt.full_moments():
        for moment, tensor in moments.items():
            expected = mine(names[id(param)], ref[-1]["moments"][names[id(param)]][moment])
            torch.testing.assert_close(tensor, expected, **TOL, msg=lambda m: f"{names[id(param)]} {moment}: {m}")


def ep2_training() -> list[tuple[int, int, int]]:
    ref = reference(4)
    coords = []
    for layout in ({"ep": 2}, {"cp": 2, "ep": 2}):
        topo = Topology.build(**layout)
        train_and_compare(topo, distributed=False, ref=ref)
        train_and_compare(topo, distributed=True, ref=ref)
        coords.append((topo.ep_rank, topo.expert_dp_rank, topo.cp_rank))
    return coords


def test_ep2_expert_gradients_norm_and_both_optimizers_equal_one_process():
    assert run_distributed(ep2_training, world_size=4) == [
        [(0, 0, 0), (0, 0, 0)], [(1, 0, 0), (0, 0, 1)], [(0, 1, 0), (1, 0, 0)], [(1, 1, 0), (1, 0, 1)]]
