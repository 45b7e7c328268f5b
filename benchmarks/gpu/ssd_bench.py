"""The SSD scan's time at the hybrid reference shapes, forward + backward, in one call (issue 36):
mtl's PyTorch chunked scan (eager and under torch.compile) beside mamba-ssm's Triton SSD, which
``mtl.models.mamba.dispatch`` runs on CUDA when it is installed.

    MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pip install --no-deps --no-build-isolation mamba-ssm
    python3 benchmarks/gpu/ssd_bench.py [--out $OUT/ssd.md]

Shapes (hybrid_reference.toml, one micro-batch of one Mamba layer): x [2, 4096, 64, 64], dt
[2, 4096, 64], A [64], B and C [2, 4096, 8, 128], chunk 128; x, B, C in bf16, dt and A in fp32.
Each row: the median of 20 timed calls after 5 warm-up ones (CUDA events), and the largest
difference of its output from the fp32 chunked scan's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mtl.models.mamba.dispatch import mamba_ssm_kernel
from mtl.models.mamba.ssd import ssd_chunked

SHAPES = dict(batch=2, length=4096, heads=64, head_dim=64, groups=8, state=128, chunk=128)


def inputs(device: str):
    s = SHAPES
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s["batch"], s["length"], s["heads"], s["head_dim"], device=device, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(s["batch"], s["length"], s["heads"], device=device, generator=g) - 3)
    A = -torch.rand(s["heads"], device=device, generator=g) * 15 - 1
    B = torch.randn(s["batch"], s["length"], s["groups"], s["state"], device=device, generator=g)
    C = torch.randn_like(B)
    return x, dt, A, B, C


def time_call(kernel, x, dt, A, B, C, autocast: bool, warmup: int = 5, iters: int = 20) -> tuple[float, torch.Tensor]:
    """Median ms of forward + backward, and the output of the last call. mtl's scan is called as
    the mixer calls it in training (fp32 x, B, C under bf16 autocast: the einsums run in bf16);
    mamba-ssm's kernel takes bf16 x, B, C with fp32 dt and A."""
    leaves = [t.detach().clone() if autocast else t.detach().bfloat16() for t in (x, B, C)]
    leaves = [t.requires_grad_() for t in leaves]
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            y, _ = kernel(leaves[0], dt, A, leaves[1], leaves[2], chunk_size=SHAPES["chunk"])
        y.float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times), y.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    x, dt, A, B, C = inputs("cuda")
    reference, _ = ssd_chunked(x, dt, A, B, C, chunk_size=SHAPES["chunk"])  # fp32
    rows = {"mtl chunked (eager)": ssd_chunked, "mtl chunked (compiled)": torch.compile(ssd_chunked)}
    kernel = mamba_ssm_kernel()
    if kernel is not None:
        rows["mamba-ssm Triton SSD"] = kernel
    lines = [f"SSD scan fwd+bwd, {SHAPES}, {torch.cuda.get_device_name()}", "",
             "| kernel | ms | max abs diff vs fp32 |", "|---|---|---|"]
    for name, fn in rows.items():
        try:
            ms, y = time_call(fn, x, dt, A, B, C, autocast=name.startswith("mtl"))
            lines.append(f"| {name} | {ms:.3f} | {(y - reference).abs().max().item():.3e} |")
        except Exception as exc:  # noqa: BLE001 (one failing row must not hide the others)
            lines.append(f"| {name} | failed: {str(exc).splitlines()[-1] if str(exc) else type(exc).__name__} | |")
    if kernel is None:
        lines.append("| mamba-ssm Triton SSD | not installed | |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
