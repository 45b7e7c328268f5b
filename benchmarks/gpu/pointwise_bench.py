"""The memory-bound pieces of a layer in isolation, compiled, forward + backward, at the
reference model's shapes: how close each formulation gets to the HBM bandwidth (issue 11).

    python3 benchmarks/gpu/pointwise_bench.py [--tokens 8192] [--cases NAME ...] [--inductor NAME=VALUE ...] [--out FILE]

For each case: device time per call of its kernels (torch.profiler, mean of 20 calls) and
the bytes it must move at least, as an effective bandwidth. Cases:

- ``swiglu-cat``: mtl's MLP activation, ``silu(gate) * up`` of ``chunk(fc1_out, 2)``; its
  backward writes ``d(fc1_out)`` as one tensor (a concatenation in inductor's kernel);
- ``swiglu-two``: the same activation of two separate GEMM outputs ``gate`` and ``up``
  (what a split fc1 would give); backward writes ``dgate`` and ``dup`` separately;
- ``rmsnorm-add``: ``residual + x`` then RMSNorm in fp32 (``F.rms_norm``), as mtl's layer;
- ``rmsnorm-add-manual``: the same written as ``x * rsqrt(mean(x^2) + eps) * w``.

``--inductor NAME=VALUE`` sets ``torch._inductor.config.NAME`` first (e.g. how it lowers a
concatenation: ``max_pointwise_cat_inputs``), to measure a compiler setting on these pieces.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from profile_step import kernels_per_call


def swiglu_cat(fc1_out):
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_two(gate, up):
    return F.silu(gate) * up


def rmsnorm_add(x, residual, weight):
    hidden = residual + x
    return hidden, F.rms_norm(hidden.float(), (hidden.shape[-1],), weight.float(), 1e-5).to(x.dtype)


def rmsnorm_add_manual(x, residual, weight):
    hidden = residual + x
    h = hidden.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    return hidden, normed.to(x.dtype)


def kernel_ms(fn, calls: int = 20) -> tuple[float, list[tuple[str, float]]]:
    rows = [(key, ms) for key, ms, _ in kernels_per_call(fn, calls)]
    return sum(ms for _, ms in rows), rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", nargs="+", default=None, help="only these cases")
    parser.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    import ast

    import torch._inductor.config as inductor_config

    for item in args.inductor:
        name, _, value = item.partition("=")
        if not hasattr(inductor_config, name):
            parser.error(f"--inductor {item}: torch._inductor.config has no {name!r}")
        setattr(inductor_config, name, ast.literal_eval(value))
    t, h, f = args.tokens, args.hidden, args.ffn
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    cases = {}

    fc1_out = torch.randn(t, 2 * f, **bf16, requires_grad=True)
    dh = torch.randn(t, f, **bf16)
    cat_fn = torch.compile(swiglu_cat)
    # forward: read gate and up, write h; backward: read gate, up and dh, write dgate and dup
    swiglu_bytes = 2 * (3 * t * f + 5 * t * f)
    cases["swiglu-cat"] = (lambda: cat_fn(fc1_out).backward(dh), swiglu_bytes)
    gate = torch.randn(t, f, **bf16, requires_grad=True)
    up = torch.randn(t, f, **bf16, requires_grad=True)
    two_fn = torch.compile(swiglu_two)
    cases["swiglu-two"] = (lambda: two_fn(gate, up).backward(dh), swiglu_bytes)

    x = torch.randn(t, h, **bf16, requires_grad=True)
    residual = torch.randn(t, h, **bf16, requires_grad=True)
    weight = torch.ones(h, device="cuda", dtype=torch.float32, requires_grad=True)
    dy, dhid = torch.randn(t, h, **bf16), torch.randn(t, h, **bf16)
    # forward: read x, residual; write hidden, normed. backward: read dy, dhidden, hidden; write dx (= dresidual)
    norm_bytes = 2 * t * h * (4 + 4)
    for name, fn in (("rmsnorm-add", rmsnorm_add), ("rmsnorm-add-manual", rmsnorm_add_manual)):
        compiled = torch.compile(fn)

        def call(compiled=compiled):
            hidden, normed = compiled(x, residual, weight)
            torch.autograd.backward([hidden, normed], [dhid, dy])

        cases[name] = (call, norm_bytes)

    lines = [f"# Memory-bound pieces, compiled, forward + backward ({t} tokens, hidden {h}, ffn {f}); "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
             + (f"; inductor {', '.join(args.inductor)}" if args.inductor else ""), "",
             "| case | kernels ms/call | least bytes | effective TB/s |", "|---|---|---|---|"]
    detail = []
    for name, (fn, least) in cases.items():
        if args.cases and name not in args.cases:
            continue
        total, rows = kernel_ms(fn)
        lines.append(f"| {name} | {total:.4f} | {least / 1e6:.0f} MB | {least / total / 1e9:.2f} |")
        detail += [f"- {name}:"] + [f"  - {ms:.4f} ms `{k[:100]}`" for k, ms in rows[:8]]
    text = "\n".join(lines + [""] + detail) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
