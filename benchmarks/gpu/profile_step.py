"""Profile a few training steps and show where the time goes.

    python3 benchmarks/gpu/profile_step.py benchmarks/gpu/llama_reference.toml [--set ...] [--markdown FILE]

Runs two warm-up steps, then profiles two with torch.profiler; prints the top kernels and
operators by CUDA time (by CPU time on a machine without CUDA). ``--markdown`` also writes
the top kernels as a markdown table (what ``bench_speed.py --profile`` writes). The pieces
(``mtl_step``, ``profile_steps``, ``kernel_table``) serve bench_speed.py too. ``--as-rank R/W``
profiles one rank of a layout alone, its collectives moving nothing (``fake_group.py``)."""

from __future__ import annotations

import argparse
import re
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from fake_group import AS_RANK_HELP, join_fake_group

# Kernel name -> what it is, first match wins (for the per-category summary).
CATEGORIES = [
    ("attention", r"flash|fmha|cudnn.*(attn|sdpa|mha)|attention|sdpa"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|sm80_|aten::(mm|addmm|bmm|linear)$"),
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("compiled (triton)", r"^triton_|triton"),
    ("copy / cast", r"copy|cast|convert|to_copy|memcpy|memset|fill"),
    ("reduction / norm", r"reduce|norm|softmax|sum|max"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
               "cudaEventSynchronize")


def mtl_step(config_path: str | None, overrides: list[str]) -> tuple[Callable[[], None], object]:
    """(one training iteration of mtl as the trainer runs it, the resolved config)."""
    from mtl.core.config_io import load_config
    from mtl.train.batches import MicroBatches
    from mtl.train.precision import LossScaler
    from mtl.train.setup import setup
    from mtl.train.step import queue_train_step

    run = setup(load_config(config_path, overrides))
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, 0)
    micro = [batches.take(t.num_micro_batches)]

    def step() -> None:  # as the loop: the next batches are taken before the host waits
        pending = queue_train_step(cfg, run.topology, run.chunks, run.optimizer,
                                   [iter(micro[0]) for _ in run.chunks], scaler, t.lr, run.device)
        micro[0] = batches.take(t.num_micro_batches)
        pending.result()

    return step, cfg


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def profile_steps(step: Callable[[], object], warmup: int = 2, steps: int = 2, record_shapes: bool = False,
                  device_only: bool = False):
    """Run ``warmup`` steps, then profile ``steps`` more; returns the profiler
    (``record_shapes``: operators keep their inputs' shapes, for ``gemm_table``; ``device_only``:
    the device's activity alone, so that recording the host's operators does not slow the host
    and open gaps of its own)."""
    for _ in range(warmup):
        step()
    _sync()
    activities = [] if device_only else [ProfilerActivity.CPU]
    activities += [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            step()
        _sync()
    return prof


def _device_time(evt) -> float:
    """Self time on the device in µs (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def cuda_ms_per_call(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Device time per call of ``fn`` in ms, by CUDA events over ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernels_per_call(fn: Callable[[], object], calls: int = 20, warmup: int = 3) -> list[tuple[str, float, int]]:
    """(kernel, device ms per call, launches per call) of ``fn``, largest first: ``warmup``
    calls, then ``calls`` profiled ones (the small benchmarks' kernel tables)."""
    from torch.autograd import DeviceType

    prof = profile_steps(fn, warmup=warmup, steps=calls)
    # kernels only: the operator that launched a kernel (aten::add_, an inductor triton_* call)
    # carries the same device time as its own row, and would count it twice in a sum
    rows = [(e.key, _device_time(e) / calls / 1e3, e.count // calls) for e in prof.key_averages()
            if getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and _device_time(e) > 0]
    return sorted(rows, key=lambda r: -r[1])


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


def _gemm_flops(op: str, shapes: list) -> float:
    """2·M·N·K of one GEMM operator from its inputs' shapes (addmm/baddbmm: the matrices are
    inputs 1 and 2)."""
    a, b = (shapes[1], shapes[2]) if op in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _kernels_below(evt) -> list:
    """The device kernels an operator launched, its own and its children's."""
    found = list(getattr(evt, "kernels", []))
    for child in getattr(evt, "cpu_children", []):
        found += _kernels_below(child)
    return found


def gemm_table(prof, steps: int) -> str:
    """Markdown: every GEMM shape of the profiled steps (a profile taken with
    ``record_shapes``), with the kernel cuBLAS chose, its calls and device time per step and its
    rate. Shows which GEMM of a layer runs below the device's matmul rate, and under which
    kernel name it appears in ``kernel_table``."""
    rows: dict[tuple, list[float]] = {}
    for e in prof.events():
        if e.name not in GEMM_OPS or not e.input_shapes:
            continue
        kernels = _kernels_below(e)
        if not kernels:
            continue
        shapes = [list(s) for s in e.input_shapes if s]
        key = (e.name, str(shapes), " + ".join(sorted({k.name for k in kernels})))
        entry = rows.setdefault(key, [0.0, 0.0, _gemm_flops(e.name, shapes)])
        entry[0] += 1
        entry[1] += sum(k.duration for k in kernels)
    lines = ["| operator | input shapes | kernel | calls/step | ms/step | µs/call | TFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    for (op, shapes, kernel), (count, us, flops) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        rate = flops * count / (us * 1e-6) / 1e12 if us else 0.0
        lines.append(f"| {op} | {shapes} | `{kernel[:70]}` | {count / steps:g} | {us / steps / 1e3:.2f} | "
                     f"{us / count:.1f} | {rate:.0f} |")
    return "\n".join(lines) + "\n"


def category(name: str) -> str:
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def device_idle(prof, steps: int, largest: int = 8) -> str:
    """Markdown lines: how long the GPU sat idle between the first and the last kernel of the
    profiled steps (the host not keeping it fed: a sync drained the queue, or Python was slower
    than the kernels), and the largest gaps with the kernels on either side. "" without CUDA."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if getattr(e, "device_type", None) == DeviceType.CUDA and not e.is_user_annotation
                   and e.time_range.end > e.time_range.start)
    if not spans:
        return ""
    gaps = []  # (µs, kernel before, kernel after)
    busy_until, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, last, name))
        if end > busy_until:
            busy_until, last = end, name
    window = busy_until - spans[0][0]
    idle = sum(g for g, _, _ in gaps)
    gaps.sort(reverse=True)

    def short(name: str) -> str:
        return name if len(name) <= 60 else name[:57] + "..."

    lines = [f"Device idle: {idle / steps / 1e3:.1f} ms/step of {window / steps / 1e3:.1f} ms from first to last "
             f"kernel ({len(gaps)} gaps; {sum(1 for g, _, _ in gaps if g >= 100) / steps:g}/step of 0.1 ms or more). "
             "Largest gaps:", ""]
    lines += [f"- {g / 1e3:.2f} ms after `{short(before)}`, before `{short(after)}`" for g, before, after in gaps[:largest]]
    bounds = [(0, 2), (2, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))]  # µs
    lines += ["", "| gap (µs) | gaps/step | ms/step |", "|---|---|---|"]
    for low, high in bounds:
        inside = [g for g, _, _ in gaps if low <= g < high]
        label = f"{low}-{high}" if high != float("inf") else f"{low} or more"
        lines.append(f"| {label} | {len(inside) / steps:g} | "
                     f"{sum(inside) / steps / 1e3:.2f} |")
    return "\n".join(lines)


def kernel_table(prof, steps: int, rows: int = 20, title: str = "") -> str:
    """Markdown: the top ``rows`` GPU kernels by device time per step, and the time per
    category. Without CUDA events (a CPU run), the top operators by self CPU time."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # (a user annotation such as ``Optimizer.step#AdamW.step`` spans kernels: not one itself)
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA and _device_time(e) > 0
               and not getattr(e, "is_user_annotation", False)]
    if kernels:
        timed = [(e.key, e.count, _device_time(e)) for e in kernels]
        unit = "GPU kernels by device time"
    else:
        timed = [(e.key, e.count, float(e.self_cpu_time_total)) for e in events if e.self_cpu_time_total > 0]
        unit = "operators by self CPU time (no CUDA kernels recorded)"
    total = sum(t for _, _, t in timed) or 1.0
    timed.sort(key=lambda r: r[2], reverse=True)
    lines = [f"### {title}".rstrip() if title else "", "",
             f"Top {rows} {unit}, per step (mean of {steps} profiled steps); total {total / steps / 1e3:.1f} ms/step.",
             "", "| # | kernel | calls/step | ms/step | % |", "|---|---|---|---|---|"]
    for i, (name, count, t) in enumerate(timed[:rows], 1):
        short = name.replace("|", "\\|")
        short = short if len(short) <= 110 else short[:107] + "..."
        lines.append(f"| {i} | `{short}` | {count / steps:g} | {t / steps / 1e3:.3f} | {100 * t / total:.1f}% |")
    # Host synchronisation (the "one per logging interval"): a .item()/.tolist() is
    # aten::_local_scalar_dense; the CUDA runtime's synchronising calls are recorded on the CPU.
    syncs = {name: 0 for name in SYNC_EVENTS}
    for e in events:
        if e.key in syncs:
            syncs[e.key] += e.count
    sync_text = ", ".join(f"`{k}` {v / steps:g}" for k, v in syncs.items() if v)
    lines += ["", f"Host synchronisation per step: {sync_text or 'none recorded'} (`aten::_local_scalar_dense` "
              "is a .item()/float(): a sync only on a device tensor; the profiler's own end-of-window "
              "`cudaDeviceSynchronize` counts once in all)."]
    idle = device_idle(prof, steps)
    if idle:
        lines += ["", idle]
    by_cat: dict[str, float] = {}
    for name, _, t in timed:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + t
    lines += ["", "| category | ms/step | % |", "|---|---|---|"]
    for label, t in sorted(by_cat.items(), key=lambda kv: kv[1], reverse=True):
        lines.append(f"| {label} | {t / steps / 1e3:.3f} | {100 * t / total:.1f}% |")
    return "\n".join(lines).lstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--markdown", help="also write the top kernels (20) as markdown to this file")
    parser.add_argument("--as-rank", default=None, metavar="R/W", help=AS_RANK_HELP)
    parser.add_argument("--gemms", action="store_true", help="also every GEMM shape with its kernel and rate")
    parser.add_argument("--gaps", type=int, default=0, metavar="N",
                        help="only the device's idle time: profile the device alone (the host's operators "
                             "not recorded) and list the N largest gaps between kernels and all gaps by size")
    args = parser.parse_args()
    if args.as_rank:
        join_fake_group(args.as_rank)
    step, _ = mtl_step(args.config, args.overrides)
    if args.gaps:
        print(device_idle(profile_steps(step, warmup=2, steps=2, device_only=True), steps=2, largest=args.gaps))
        return
    prof = profile_steps(step, warmup=2, steps=2, record_shapes=args.gemms)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(kernel_table(prof, steps=2, rows=20, title=f"mtl, {args.config}"))
    if args.gemms:
        print(gemm_table(prof, steps=2))


if __name__ == "__main__":
    main()
