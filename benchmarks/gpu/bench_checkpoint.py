"""Checkpoint save/load throughput of the reference model on one GPU: mtl's zarr format (sync
save, async save and the stall it causes, load) beside torch.save/torch.load and
torch.distributed.checkpoint (DCP) of the same tensors, in one process, one run.

    python3 benchmarks/gpu/bench_checkpoint.py [--config benchmarks/gpu/llama_reference.toml]
        [--dir /tmp/ckpt_bench] [--set key=value ...]

The state is what a training checkpoint holds: fp32 parameters and both AdamW moments
(after one real step, so the moments are not zeros). GB/s counts those bytes. Prints a
markdown table; pass --out FILE to write it there too. Loads follow their saves, so they
read from the page cache where the machine's memory holds the files: that is the figure a
resume right after a save sees, not a cold read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp

from mtl.ckpt import AsyncSaver
from mtl.core.config_io import load_config
from mtl.train.checkpointing import load_checkpoint, save_checkpoint
from mtl.train.loop import train


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def plain_state(run) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments as one flat dict (what torch.save and DCP get)."""
    state = {}
    for chunk in run.chunks:
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            state[f"model.{name}"] = param.data
    names = {id(param): name for chunk in run.chunks
             for name, param in getattr(chunk, "module", chunk).named_parameters()}
    for i, (param, moments) in enumerate(run.optimizer.full_moments()):
        for moment, tensor in moments.items():
            if moment == "main_param":  # bf16 weights: mtl stores the fp32 main weights instead
                state[f"model.{names[id(param)]}"] = tensor.clone()
            else:
                state[f"optimizer.{i}.{moment}"] = tensor
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/gpu/llama_reference.toml")
    parser.add_argument("--dir", default="/tmp/ckpt_bench")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    cfg = load_config(args.config, ["train.iters=1", "train.warmup_iters=0", "logging.callbacks=[]", *args.set])
    result = train(cfg, progress=False)  # one real step: moments hold real values
    run = result.run
    state = plain_state(run)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gb = nbytes / 1e9
    rows = []

    def row(name: str, seconds: float, note: str = "") -> None:
        rows.append(f"| {name} | {seconds:.2f} | {gb / seconds:.2f} | {note} |")
        print(rows[-1], flush=True)

    def mtl_save(directory: str, iteration: int, saver=None):
        run.config.ckpt.save = directory
        save_checkpoint(run.config, run.topology, run.chunks, run.optimizer, iteration=iteration,
                        consumed_samples=0, scaler_state={}, saver=saver)

    zarr_dir = os.path.join(args.dir, "zarr")
    row("mtl zarr save (sync)", timed(lambda: mtl_save(zarr_dir, 1)))
    row("mtl zarr load (verify sha256)", timed(lambda: load_checkpoint(run.config, run.topology, run.chunks,
                                                                    run.optimizer, zarr_dir)))
    saver = AsyncSaver()
    stall = timed(lambda: mtl_save(zarr_dir, 2, saver))
    total = stall + timed(saver.wait)
    row("mtl zarr save (async): training stall", stall, "until save() returns (device->host copy)")
    row("mtl zarr save (async): until committed", total)

    shutil.rmtree(zarr_dir)  # each format's files go before the next is written: disk is finite
    torch_path = os.path.join(args.dir, "state.pt")
    row("torch.save", timed(lambda: torch.save(state, torch_path)))
    row("torch.load (to GPU)", timed(lambda: torch.load(torch_path, map_location=run.device)))

    os.remove(torch_path)
    dcp_dir = os.path.join(args.dir, "dcp")
    row("torch.distributed.checkpoint save", timed(lambda: dcp.save(state, checkpoint_id=dcp_dir)))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    row("torch.distributed.checkpoint load", timed(lambda: dcp.load(target, checkpoint_id=dcp_dir)))

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    header = [f"state: {gb:.2f} GB (fp32 parameters + 2 AdamW moments), {len(state)} tensors; "
              f"device {device}; torch {torch.__version__}; target {args.dir}",
              "", "| what | s | GB/s | note |", "|---|---|---|---|"]
    table = "\n".join(header + rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
