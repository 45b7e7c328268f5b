"""Summarise metrics.jsonl files of benchmark runs as a markdown table (steady state:
the median over iterations after the first `--skip`)."""

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="NAME=PATH/metrics.jsonl")
    parser.add_argument("--skip", type=int, default=3)
    args = parser.parse_args()
    print("| run | s/iter | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB |")
    print("|---|---|---|---|---|---|")
    for item in args.runs:
        name, path = item.split("=", 1)
        rows = [json.loads(l) for l in Path(path).read_text().splitlines() if '"tokens_per_s"' in l]
        rows = rows[args.skip:] or rows
        med = lambda k: statistics.median(r[k] for r in rows if k in r) if any(k in r for r in rows) else float("nan")
        print(f"| {name} | {med('iter_s'):.3f} | {med('tokens_per_s'):,.0f} | {med('tflops_per_gpu'):.1f} | "
              f"{100 * med('mfu'):.1f}% | {max(r.get('mem_gb', 0) for r in rows):.1f} |")


if __name__ == "__main__":
    main()
