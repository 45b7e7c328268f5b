"""On a GPU with Transformer Engine staged (benchmarks/gpu/te_stage.sh): the tiny model of
mtl.train.testing trained a few steps by each backend, losses side by side, and the te
backend in bf16 checked against the local backend in bf16 (same weights, same batches).

    python3 benchmarks/gpu/te_check.py [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from mtl.train.testing import run_tiny

RUNS = {
    "local bf16": ["model.backend='local'"],
    "te bf16": ["model.backend='te'"],
    "te fp8 delayed": ["model.backend='te'", "train.fp8='delayed'"],
    "te fp8 current": ["model.backend='te'", "train.fp8='current'"],
    "te fp8 blockwise": ["model.backend='te'", "train.fp8='blockwise'"],
    "fp8 current": ["model.backend='fp8'", "train.fp8='current'"],
    "fp8 rowwise": ["model.backend='fp8'", "train.fp8='rowwise'", "train.fp8_format='e4m3'"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    common = [f"train.iters={args.iters}", "train.device='cuda'", "train.precision='bf16'", "model.hidden_size=64",
              "model.num_attention_heads=4", "model.seq_length=64"]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    losses = {}
    for name, overrides in RUNS.items():
        start = time.time()
        try:
            result = run_tiny([*common, *overrides], with_grads=False)
        except Exception as exc:  # report every backend, whatever one of them does
            print(f"{name:18s} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        losses[name] = result["losses"]
        steps = sorted(result["losses"])
        shown = " ".join(f"{result['losses'][s]:.4f}" for s in steps[:: max(1, len(steps) // 5)])
        print(f"{name:18s} {shown}  last {result['losses'][steps[-1]]:.4f}  ({time.time() - start:.1f} s)")
    if "te bf16" in losses:
        ref, te = losses["local bf16"], losses["te bf16"]
        worst = max(abs(te[s] - ref[s]) / ref[s] for s in ref)
        print(f"te bf16 vs local bf16: largest relative loss difference {worst:.2e}")


if __name__ == "__main__":
    main()
