"""The LM head + loss of the reference model alone, forward + backward, on one GPU (issue 11):
mtl's fused head (``linear_cross_entropy``, the path ``mtl train`` takes) against the
unfused pair a plain model runs (``F.linear`` then ``F.cross_entropy``), with their kernels.

    python3 benchmarks/gpu/lm_head_bench.py [--tokens 8192] [--vocab 50304] [--hidden 2048] [--out FILE]

Rows (all bf16 compute over bf16 weights, one micro-batch of ``--tokens`` tokens):

- ``mtl-fused``: ``linear_cross_entropy`` with the weight gradient accumulated into an fp32
  ``main_grad`` (gradient-accumulation fusion, as under ``train.params_dtype = "bf16"``),
  logits kept for backward (the default for bf16), chunk kernels compiled;
- ``mtl-recompute``: the same, logits recomputed in backward (``save_logits=False``);
- ``unfused``: ``F.cross_entropy(F.linear(x, W).float(), target)`` eager, what the peer's
  head does.

For each row: device time per call (torch.profiler, mean of ``--calls`` calls), the GEMMs'
share and rate (``6 * tokens * hidden * vocab`` FLOPs; 8 for ``mtl-recompute``), the peak
memory above the inputs, and the kernels that take the time. Before timing, each row's loss
and gradients are printed as their largest difference from the unfused row's (relative to its
largest value): a check to read, not an assertion.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from mtl.parallel.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from profile_step import kernels_per_call

GEMM_KEYS = ("gemm", "nvjet", "cutlass", "sm90", "xmma", "matmul")


def make_inputs(tokens: int, hidden: int, vocab: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(tokens, hidden, device="cuda", generator=g) * 1.0).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    return x, w, target


def fused_step(x, w, target, save_logits):
    w.wgrad_fused = True
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if not hasattr(w, "main_grad") \
        else w.main_grad

    def step():
        loss = linear_cross_entropy(x, w, target, compile=True, save_logits=save_logits)
        loss.sum().backward()
        return loss
    return step


def unfused_step(x, w, target):
    def step():
        loss = F.cross_entropy(F.linear(x, w).float(), target, reduction="none")
        loss.sum().backward()
        return loss
    return step


def reset(x, w):
    x.grad = None
    w.grad = None
    if hasattr(w, "main_grad"):
        w.main_grad.zero_()


def gradients(step, x, w):
    reset(x, w)
    loss = step()
    dw = w.main_grad.clone() if getattr(w, "wgrad_fused", False) else w.grad.float()
    return loss.detach().float(), x.grad.float(), dw


def timed(step, x, w, calls: int):
    def call():
        x.grad = None
        w.grad = None
        step()

    reset(x, w)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rows = kernels_per_call(call, calls)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return rows, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    flops = 2 * args.tokens * args.hidden * args.vocab
    lines = [f"# LM head + loss, {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}, bf16, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}", ""]

    cases = {}
    for name, save in (("mtl-fused", None), ("mtl-recompute", False)):
        x, w, target = make_inputs(args.tokens, args.hidden, args.vocab)
        cases[name] = (fused_step(x, w, target, save), x, w, 4 if save is False else 3)
    x, w, target = make_inputs(args.tokens, args.hidden, args.vocab)
    cases["unfused"] = (unfused_step(x, w, target), x, w, 3)

    ref = gradients(*cases["unfused"][:3])
    for name, (step, x, w, _) in cases.items():
        loss, dx, dw = gradients(step, x, w)
        errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip((loss, dx, dw), ref)]
        lines.append(f"- {name}: max error relative to the unfused row's largest value: loss {errs[0]:.1e}, "
                     f"dx {errs[1]:.1e}, dW {errs[2]:.1e}")
    lines.append("")
    lines.append("| row | ms per call | GEMM ms | GEMM TFLOP/s | other ms | peak GiB above inputs |")
    lines.append("|---|---|---|---|---|---|")
    details = []
    for name, (step, x, w, gemms) in cases.items():
        rows, peak = timed(step, x, w, args.calls)
        total = sum(ms for _, ms, _ in rows)
        gemm_ms = sum(ms for key, ms, _ in rows if any(k in key.lower() for k in GEMM_KEYS))
        rate = gemms * flops / (gemm_ms / 1e3) / 1e12 if gemm_ms else float("nan")
        lines.append(f"| {name} | {total:.3f} | {gemm_ms:.3f} | {rate:.0f} | {total - gemm_ms:.3f} | {peak:.2f} |")
        details.append(f"\n{name}, kernels (ms per call, launches per call):")
        details.extend(f"  {ms:8.3f}  x{count:<3d} {key[:110]}" for key, ms, count in rows[:12])
    text = "\n".join(lines + details) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
