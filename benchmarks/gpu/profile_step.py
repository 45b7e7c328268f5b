"""Profile a few training steps on one GPU and print where the CUDA time goes.

    python3 benchmarks/gpu/profile_step.py benchmarks/gpu/llama_reference.toml [--set ...]

Runs two warm-up steps, then profiles two with torch.profiler; prints the top kernels
and operators by CUDA time."""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mtl.core.config_io import load_config
from mtl.train.batches import MicroBatches
from mtl.train.precision import LossScaler
from mtl.train.setup import setup
from mtl.train.step import train_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args()
    run = setup(load_config(args.config, args.overrides))
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, 0)

    def step():
        micro = batches.take(t.num_micro_batches)
        train_step(cfg, run.topology, run.chunks, run.optimizer,
                   [iter(micro) for _ in run.chunks], scaler, t.lr, run.device)
        torch.cuda.synchronize()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows)
    print(table)


if __name__ == "__main__":
    main()
