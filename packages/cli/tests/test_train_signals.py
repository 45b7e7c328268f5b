"""A real ``mtl train`` process stopped by a real signal saves the step it stopped at and exits
128 + the signal's number: 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _last_step(logs: Path) -> int:
    path = logs / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")] \
        if path.exists() else []
    return steps[-1] if steps else 0


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_then_exits_128_plus_its_number(tiny_toml, workdir, signum, code):
    logs, ckpt = workdir / "logs", workdir / "ckpt"
    cmd = [sys.executable, "-m", "mtl.cli", "train", str(tiny_toml), "--set", "train.iters=100000",
           "--set", "logging.interval=1", "--set", f"logging.dir={json.dumps(str(logs))}",
           "--set", f"ckpt.save={json.dumps(str(ckpt))}", "--set", "logging.progress='none'"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while _last_step(logs) < 2:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "training did not reach step 2"
            time.sleep(0.02)
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, output[-3000:]
    stopped_at = _last_step(logs)
    assert f"stopped at iteration {stopped_at} (signal)" in output
    assert int((ckpt / "latest").read_text()) == stopped_at  # saved before exiting
