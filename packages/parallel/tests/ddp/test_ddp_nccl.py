"""DataParallel + both optimizers on two GPUs over NCCL (fused AdamW, CUDA streams): the same
equivalences as the gloo tests. Skipped on machines with fewer than two CUDA devices (CI)."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mtl.parallel.ddp import DataParallel
from mtl.parallel.optimizer import build_optimizer
from mtl.parallel.testing import free_port
from mtl.parallel.topology import Topology

WORLD_SIZE = 2
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
TINY_BUCKET_MB = 100 * 4 / 2**20
CONFIGS = [(overlap, dist_opt) for overlap in (True, False) for dist_opt in (False, True)]

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason=f"needs {WORLD_SIZE} CUDA devices")


def make_model(device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model.to(device)


def make_batch(step: int, device):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(8, 8, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)


def reference(device, num_steps: int):
    """Grads before each step and params after it, one GPU, the whole batch, fused torch AdamW."""
    model = make_model(device)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith("bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], fused=True)
    grads, params = [], []
    for step in range(num_steps):
        opt.zero_grad()
        x, y = make_batch(step, device)
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return grads, params


def nccl_rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD_SIZE, device_id=device,
                            timeout=datetime.timedelta(minutes=2))
    errors = {}
    try:
        topo = Topology.build()
        ref_grads, ref_params = reference(device, 3)
        for overlap, dist_opt in CONFIGS:
            model = DataParallel(make_model(device), topo, bucket_size_mb=TINY_BUCKET_MB,
                                 overlap_grad_reduce=overlap, use_distributed_optimizer=dist_opt)
            opt = build_optimizer(model, topo, use_distributed_optimizer=dist_opt, **ADAMW)
            grad_err = param_err = 0.0
            for step in range(3):
                opt.zero_grad()
                x, y = make_batch(step, device)
                xs, ys = x.chunk(WORLD_SIZE)[rank], y.chunk(WORLD_SIZE)[rank]
                with model.no_sync():
                    (nn.functional.mse_loss(model(xs[:2]), ys[:2]) / 2).backward()
                (nn.functional.mse_loss(model(xs[2:]), ys[2:]) / 2).backward()
                model.finish_grad_sync()
                for p, g in zip(model.parameters(), ref_grads[step]):
                    first, last = p.dp_owned_grad_range if dist_opt else (0, p.numel())
                    diff = (p.grad.reshape(-1)[first:last] - g.reshape(-1)[first:last]).abs()
                    grad_err = max(grad_err, diff.max().item() if diff.numel() else 0.0)
                opt.clip_grad_norm(MAX_NORM)
                opt.step()
                for p, p_ref in zip(model.parameters(), ref_params[step]):
                    param_err = max(param_err, (p - p_ref).abs().max().item())
            errors[(overlap, dist_opt)] = (grad_err, param_err, model.num_collectives_launched, len(model.buckets))
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def per_rank():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(nccl_rank, args=(free_port(), out_dir), nprocs=WORLD_SIZE, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("overlap,dist_opt", CONFIGS)
def test_nccl_gradients_and_adamw_steps_match_one_gpu(per_rank, overlap, dist_opt):
    for errors in per_rank:
        grad_err, param_err, launched, num_buckets = errors[(overlap, dist_opt)]
        assert num_buckets > 1 and launched == num_buckets
        assert grad_err <= 1e-6, grad_err
        assert param_err <= 1e-5, param_err  # fused AdamW kernels of different tensor lists
