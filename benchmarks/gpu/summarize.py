"""Summarise the metrics.jsonl files of benchmark runs as a markdown table: the median over
the iterations after the first ``--skip`` (warm-up), and, with ``--baseline NAME``, the
scaling efficiency of each run's tokens/s per GPU against that run's."""

import argparse
import json
import statistics
from pathlib import Path


def steady_state(path: str, skip: int) -> dict[str, float] | None:
    """The run's medians, or None where it logged no step (it failed or ran out of time)."""
    file = Path(path)
    rows = [json.loads(line) for line in file.read_text().splitlines() if '"tokens_per_s"' in line] if file.exists() else []
    if not rows:
        return None
    steady = rows[skip:] or rows
    keys = {k for r in steady for k, v in r.items() if isinstance(v, (int, float))}
    summary = {k: statistics.median(r[k] for r in steady if k in r) for k in keys}
    summary["mem_gb"] = max(r.get("mem_gb", 0.0) for r in rows)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="NAME=PATH/metrics.jsonl")
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--baseline", help="NAME of the one-GPU run to compute scaling efficiency against")
    args = parser.parse_args()
    runs = {name: steady_state(path, args.skip) for name, path in (item.split("=", 1) for item in args.runs)}
    if args.baseline and runs.get(args.baseline) is None:
        raise SystemExit(f"--baseline {args.baseline}: no such run with logged steps (have {', '.join(runs)})")
    base = runs[args.baseline]["tokens_per_s_per_gpu"] if args.baseline else None
    print("| run | s/iter | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU | peak mem GiB |" + (" scaling eff. |" if base else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if base else ""))
    for name, m in runs.items():
        if m is None:  # one failed run leaves the others' rows standing
            print(f"| {name} | no logged steps (failed or timed out: see its log) |")
            continue
        line = (f"| {name} | {m['iter_s']:.3f} | {m['tokens_per_s']:,.0f} | {m.get('tokens_per_s_per_gpu', float('nan')):,.0f} | "
                f"{m['tflops_per_gpu']:.1f} | {100 * m.get('mfu', float('nan')):.1f}% | {m['mem_gb']:.1f} |")
        if base:
            line += f" {100 * m['tokens_per_s_per_gpu'] / base:.0f}% |"
        print(line)


if __name__ == "__main__":
    main()
