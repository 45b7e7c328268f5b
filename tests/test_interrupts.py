"""Runs that survive, with real processes and real signals: Ctrl-C (SIGINT) at a random step
saves that step and the same command resumes; a second Ctrl-C aborts at once without
committing anything; ``torchrun --max-restarts 1`` with one rank SIGKILLed mid-run restarts
the job by itself and its losses from the restored step on equal an uninterrupted run's,
bit for bit. Tiny model, CPU, gloo."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from process_tree import children, rank_of  # noqa: E402  (a helper beside these tests)

BIN = Path(sys.executable).parent
CONFIG = """
[model]
num_layers = 2
hidden_size = 64
num_attention_heads = 4
seq_length = 64
[data]
dataset = "mock"
tokenizer = "byte"
[train]
micro_batch_size = 2
global_batch_size = 8
iters = {iters}
warmup_iters = 2
eval_interval = 0
device = "cpu"
[logging]
interval = 1
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def write_config(tmp_path: Path, iters: int) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.format(iters=iters))
    return path


def read_metrics(directory: Path) -> list[dict]:
    path = directory / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_step(proc: subprocess.Popen, logs: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not read_metrics(logs) or read_metrics(logs)[-1]["step"] < step:
        assert proc.poll() is None, f"exited early: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "training did not reach the step"
        time.sleep(0.02)


def test_ctrl_c_saves_the_step_it_stopped_at_and_the_same_command_resumes(tmp_path):
    config = write_config(tmp_path, iters=100_000)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    cmd = [str(BIN / "python"), "-m", "mtl.cli", "train", str(config),
           "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{ckpt}'"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        wait_for_step(proc, logs, random.randint(2, 6))
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, output[-3000:]
    stopped_at = read_metrics(logs)[-1]["step"]
    assert f"stopped at iteration {stopped_at} (signal)" in output
    assert "SIGINT: stopping after this step and saving a checkpoint" in output
    assert f"saved checkpoint {ckpt / f'iter_{stopped_at:07d}'}" in output
    assert int((ckpt / "latest").read_text()) == stopped_at
    # the same command (only the length changed) resumes: no ckpt.load needed
    again = subprocess.run([*cmd, "--set", f"train.iters={stopped_at + 2}"], capture_output=True, text=True,
                           timeout=120, env=ENV)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming at iteration {stopped_at} from {ckpt / f'iter_{stopped_at:07d}'}" in again.stderr
    assert [r["step"] for r in read_metrics(logs)][-2:] == [stopped_at + 1, stopped_at + 2]


def test_a_second_ctrl_c_aborts_without_saving(tmp_path):
    config = write_config(tmp_path, iters=100_000)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    cmd = [str(BIN / "python"), "-m", "mtl.cli", "train", str(config), "--set", "model.num_layers=8",
           "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{ckpt}'"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        wait_for_step(proc, logs, 2)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, output[-3000:]
    assert output.rstrip().endswith("aborted"), output[-3000:]
    assert not (ckpt / "latest").exists()  # nothing committed: a save it interrupted stays .partial


def _torchrun(tmp_path: Path, name: str, iters: int) -> tuple[list[str], Path]:
    config = write_config(tmp_path, iters=iters)
    logs = tmp_path / name / "logs"
    with socket.socket() as sock:  # a free port per job: two run side by side
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(BIN / "python"), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.2", "--master-port", str(port), "-m", "mtl.cli", "train", str(config),
           "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{tmp_path / name / 'ckpt'}'",
           "--set", "ckpt.interval=4", "--set", "logging.progress='none'"]
    return cmd, logs


def test_torchrun_restarts_a_job_whose_rank_was_killed_and_it_continues_exactly(tmp_path):
    iters = 16
    straight_cmd, straight_logs = _torchrun(tmp_path, "straight", iters)
    cmd, logs = _torchrun(tmp_path, "killed", iters)
    # the uninterrupted run alongside (the same job, never killed)
    straight = subprocess.Popen(straight_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        wait_for_step(proc, logs, 6)
        victims = [pid for pid in children(proc.pid) if rank_of(pid) == 1]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
        straight_output, _ = straight.communicate(timeout=120)
    finally:  # torchrun's workers run in sessions of their own: end them too if the test failed
        for job in (proc, straight):
            if job.poll() is None:
                for pid in children(job.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                job.kill()
    assert proc.returncode == 0, output[-4000:]  # finished by itself, on the second attempt
    assert straight.returncode == 0, straight_output[-3000:]
    restored = int(re.search(r"resuming at iteration (\d+) from", output).group(1))
    assert restored >= 4 and restored % 4 == 0
    expected = {r["step"]: r["loss"] for r in read_metrics(straight_logs)}
    rows = read_metrics(logs)
    second_attempt = rows[max(i for i, r in enumerate(rows) if r["step"] == restored + 1):]
    assert [r["step"] for r in second_attempt] == list(range(restored + 1, iters + 1))
    for row in second_attempt:
        assert row["loss"] == expected[row["step"]], (row["step"], row["loss"], expected[row["step"]])
    assert (tmp_path / "killed" / "ckpt" / "latest").read_text().strip() == str(iters)
