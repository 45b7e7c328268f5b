"""Is the step bound by the host? Time to queue a training step against the whole step.

    python3 benchmarks/gpu/queue_time.py [--set KEY=VALUE ...] [--steps 6]

Runs the reference model (``llama_reference.toml``) as the trainer does (``queue_train_step``,
then ``PendingStep.result()``) and prints, per step after two warm-up steps, how long the host
took to queue the step's work and how long the step took in all. When the queueing takes
about as long as the step, the device waits on Python (launches, custom-op dispatch, hooks)
and faster kernels will not show; when it is much shorter, the device is the bound. (The
CUDA launch queue holds about a thousand kernels, so a host far ahead blocks too: with tiny
shapes, e.g. ``--set model.seq_length=64 --set train.micro_batch_size=1``, the step time is
the host's alone.) ``--cprofile`` lists the host's top Python functions over one more step.

``--as-rank R/W`` runs this one process as rank R of a W-process job whose collectives move
nothing (``fake_group.py``), e.g. ``--as-rank 0/2 --set parallel.tp=2 --set
parallel.sequence_parallel=true``: the step time is then that rank's compute and host time
alone, the floor its layout could reach with every transfer hidden. Against the layout's
measured step on W GPUs, the difference is what the communication costs. The received data
are garbage (the loss may read nan); only the time means something.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fake_group import AS_RANK_HELP, join_fake_group  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cprofile", action="store_true", help="also the host's top functions over one more step")
    parser.add_argument("--as-rank", default=None, metavar="R/W", help=AS_RANK_HELP)
    args = parser.parse_args()
    if args.as_rank:
        join_fake_group(args.as_rank)
    from mtl.core.config_io import load_config
    from mtl.train.batches import MicroBatches
    from mtl.train.precision import LossScaler
    from mtl.train.setup import setup
    from mtl.train.step import queue_train_step

    from bench_speed import _bench_keys

    # enough samples for the warm-up, the timed steps, the profiled one and the batch taken ahead
    iters = f"train.iters={args.steps + 4}"
    run = setup(load_config(str(HERE / "llama_reference.toml"), [iters, *_bench_keys(args.sets)]))
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, 0)
    micro = batches.take(t.num_micro_batches)
    queued, total = [], []
    for i in range(args.steps + 2):
        began = time.perf_counter()
        pending = queue_train_step(cfg, run.topology, run.chunks, run.optimizer, [iter(micro) for _ in run.chunks],
                                   scaler, t.lr, run.device)
        queued_at = time.perf_counter()
        micro = batches.take(t.num_micro_batches)
        result = pending.result()
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            queued.append(queued_at - began)
            total.append(time.perf_counter() - began)
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        pending = queue_train_step(cfg, run.topology, run.chunks, run.optimizer, [iter(micro) for _ in run.chunks],
                                   scaler, t.lr, run.device)
        pending.result()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    q, s = statistics.median(queued), statistics.median(total)
    print(f"{' '.join(args.sets) or 'reference'}: queueing {q * 1e3:.1f} ms of a {s * 1e3:.1f} ms step "
          f"({100 * q / s:.0f}%), loss {result.loss:.3f}")


if __name__ == "__main__":
    main()
