"""Run a command and report the GPU's SM clock, power and throttle reasons while it ran
(issue 11: are the step's GEMMs slower than alone because the device is at its power limit?).

    python3 benchmarks/gpu/gpu_clocks.py [--label NAME] [--out FILE] [--gpu INDEX] -- COMMAND ...

``--gpu`` is nvidia-smi's index (the physical one, not the command's CUDA_VISIBLE_DEVICES).

Samples ``nvidia-smi`` every 100 ms during COMMAND and summarises the samples with the GPU
busy (utilisation at least 90%): median and 10th percentile of the SM clock, median power
against the limit, and how often each throttle reason was active. The summary is printed and,
with ``--out``, appended to FILE as one markdown table row.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_FIELDS = ("utilization.gpu", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu",
           "{prefix}.sw_power_cap", "{prefix}.hw_slowdown", "{prefix}.sw_thermal_slowdown")
NUM_FIELDS = len(_FIELDS)


def fields() -> tuple[str, ...]:
    """The query fields; newer drivers call the throttle reasons ``clocks_event_reasons``."""
    prefix = "clocks_throttle_reasons"
    probe = subprocess.run(["nvidia-smi", "--query-gpu=clocks_event_reasons.sw_power_cap", "--format=csv,noheader"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        prefix = "clocks_event_reasons"
    return tuple(f.format(prefix=prefix) for f in _FIELDS)


def _number(text: str) -> float | None:
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


def summarise(lines: list[str]) -> dict:
    busy = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != NUM_FIELDS:
            continue
        util, clock, power = _number(cells[0]), _number(cells[1]), _number(cells[3])
        if util is not None and util >= 90 and clock is not None and power is not None:
            busy.append(cells)
    if not busy:
        return {"samples": 0}
    clocks = sorted(_number(c[1]) for c in busy)
    power = [_number(c[3]) for c in busy]
    active = {name: sum(c[i].lower() == "active" for c in busy) / len(busy)
              for i, name in ((6, "power cap"), (7, "hw slowdown"), (8, "thermal"))}
    return {
        "samples": len(busy),
        "sm_clock_median": statistics.median(clocks),
        "sm_clock_p10": clocks[len(clocks) // 10],
        "sm_clock_max": _number(busy[0][2]),
        "power_median": statistics.median(power),
        "power_limit": _number(busy[0][4]),
        "temperature_max": max((t for t in (_number(c[5]) for c in busy) if t is not None), default=None),
        "throttled": active,
    }


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="command")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gpu", type=int, default=0, help="the GPU index to sample")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    # Samples go to a file, not a pipe: nobody reads a pipe until the command ends, and once its
    # 64 KiB buffer is full (~70 s of samples) nvidia-smi blocks and stops sampling.
    with tempfile.TemporaryFile("w+") as samples:
        sampler = subprocess.Popen(
            ["nvidia-smi", "-i", str(args.gpu), f"--query-gpu={','.join(fields())}", "--format=csv,noheader",
             "-lms", "100"], stdout=samples, text=True)
        try:
            rc = subprocess.call(command)
        finally:
            sampler.send_signal(signal.SIGINT)  # nvidia-smi flushes its last samples on SIGINT
            try:
                sampler.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sampler.kill()
                sampler.wait()
        samples.seek(0)
        s = summarise(samples.read().splitlines())
    if not s["samples"]:
        line = f"| {args.label} | no busy samples | | | | |"
    else:
        throttled = ", ".join(f"{k} {v:.0%}" for k, v in s["throttled"].items() if v > 0) or "none"
        line = (f"| {args.label} | {s['sm_clock_median']:.0f} (p10 {s['sm_clock_p10']:.0f}, max {s['sm_clock_max']:.0f}) "
                f"| {s['power_median']:.0f} / {s['power_limit']:.0f} W "
                f"| {'n/a' if s['temperature_max'] is None else format(s['temperature_max'], '.0f') + ' C'} "
                f"| {throttled} | {s['samples']} |")
    print("| run | SM clock MHz, busy samples | power / limit | max temp | throttle reasons active | samples |")
    print(line)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")
    sys.exit(rc)


if __name__ == "__main__":
    main()
