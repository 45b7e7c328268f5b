"""The launch paths users run: `torchrun -m mtl.cli train` and `mtl train --nproc-per-node N`
with several processes, and a preempted run (SIGTERM) that saves where it stopped, exits 143
and resumes from there. Real processes, tiny model, CPU."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from process_tree import children, rank_of  # noqa: E402  (a helper beside these tests)

BIN = Path(sys.executable).parent
CONFIG = """
[model]
num_layers = 2
hidden_size = 32
num_attention_heads = 4
seq_length = 16
[data]
dataset = "mock"
tokenizer = "byte"
[train]
micro_batch_size = 2
global_batch_size = 4
iters = {iters}
warmup_iters = 0
eval_interval = 0
device = "cpu"
[logging]
interval = 1
"""


def write_config(tmp_path: Path, iters: int) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.format(iters=iters))
    return path


def read_metrics(directory: Path) -> list[dict]:
    path = directory / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_torchrun_two_stages_logs_once_and_saves(tmp_path):
    config = write_config(tmp_path, iters=4)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "mtl.cli", "train", str(config),
         "--set", "parallel.pp=2", "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{ckpt}'"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(logs)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer: the last stage's first rank
    assert (ckpt / "latest").read_text().strip() == "4"


def cli_losses(tmp_path: Path, config: Path, launcher: list[str], *sets: str) -> tuple[list[float], str]:
    """``mtl train`` under ``launcher`` (python or torchrun) with ``--set`` items: the logged
    losses and the run's output."""
    logs = tmp_path / f"logs{len(list(tmp_path.glob('logs*')))}"
    cmd = [*launcher, "-m", "mtl.cli", "train", str(config), "--set", f"logging.dir='{logs}'"]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [row["loss"] for row in read_metrics(logs)], proc.stdout + proc.stderr


TWO_PROCESSES = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]


def assert_same_losses(single: list[float], split: list[float]) -> None:
    assert len(single) == len(split) == 3
    for one, two in zip(single, split):
        assert abs(one - two) <= 1e-5 * abs(one), (single, split)


# cp=2 as users launch it on a GPU: compiled, where the config derives all-gathered k/v; and
# the ring under FP8, whose scales must be reduced over cp (before that fix the fp8 backend's
# cp=2 gradients were 15% off one process)
CONTEXT_PARALLEL_RUNS = {
    "compiled_all_gather": ["train.compile=true"],
    "fp8_ring": ["model.backend='fp8'", "train.fp8='current'"],
}


@pytest.mark.parametrize("run", list(CONTEXT_PARALLEL_RUNS))
def test_torchrun_context_parallel_trains_like_one_process(tmp_path, run):
    """Two processes at cp=2 log the losses of one process (fp32; the layout tests compare
    gradients too)."""
    extra = CONTEXT_PARALLEL_RUNS[run]
    comm = "all_gather" if run == "compiled_all_gather" else "p2p"
    config = write_config(tmp_path, iters=3)
    single, _ = cli_losses(tmp_path, config, [str(BIN / "python")], *extra)
    split, output = cli_losses(tmp_path, config, TWO_PROCESSES, *extra, "parallel.cp=2")
    assert f"cp 0/2 ({comm})" in output, output[-3000:]  # the setup log names how the cp ranks share k/v
    assert_same_losses(single, split)


def test_torchrun_sequence_parallel_trains_like_one_process(tmp_path):
    """tp=2 with sequence parallelism, compiled: the norms' gradients are partial on each rank
    and summed over TP once per step (mtl.parallel.sequence_parallel_grads). AdamW's update
    hardly depends on a gradient's scale, so a missing sum shows in the losses only with a large
    learning rate: at 3e-2 the third step's loss then moves 1.4e-4 (relative) from one
    process's; at the default 3e-3, 4.5e-6, under the tolerance."""
    config = write_config(tmp_path, iters=3)
    sets = ["train.compile=true", "train.lr=3e-2"]
    single, _ = cli_losses(tmp_path, config, [str(BIN / "python")], *sets)
    split, _ = cli_losses(tmp_path, config, TWO_PROCESSES, *sets, "parallel.tp=2", "parallel.sequence_parallel=true")
    assert_same_losses(single, split)


def test_torchrun_hand_split_interleaved_pipeline_trains_like_one_process(tmp_path):
    """pp=2 with vpp=2 and the stages sized by ``parallel.virtual_stage_layers`` (6 layers as 2, 2,
    1, 1, the last stage the smallest as when balanced against the LM head): two torchrun
    processes log one process's losses."""
    config = write_config(tmp_path, iters=3)
    single, _ = cli_losses(tmp_path, config, [str(BIN / "python")], "model.num_layers=6")
    split, _ = cli_losses(tmp_path, config, TWO_PROCESSES, "model.num_layers=6", "parallel.pp=2", "parallel.vpp=2",
                          "parallel.virtual_stage_layers=[2, 2, 1, 1]")
    assert_same_losses(single, split)


def test_torchrun_pipeline_split_by_flops_trains_like_one_process(tmp_path):
    """The default split at pp=2 sizes the stages by FLOPs: 5 layers, which do not split evenly
    (the even split refuses them), run as 3 + 2 under two torchrun processes and log one
    process's losses."""
    config = write_config(tmp_path, iters=3)
    single, _ = cli_losses(tmp_path, config, [str(BIN / "python")], "model.num_layers=5")
    split, _ = cli_losses(tmp_path, config, TWO_PROCESSES, "model.num_layers=5", "parallel.pp=2")
    assert_same_losses(single, split)


def test_sigterm_saves_the_current_step_and_resume_continues(tmp_path):
    config = write_config(tmp_path, iters=100_000)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    cmd = [str(BIN / "python"), "-m", "mtl.cli", "train", str(config),
           "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{ckpt}'"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(logs)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]  # 143: stopped by SIGTERM, saved
    stopped_at = read_metrics(logs)[-1]["step"]
    assert stopped_at >= 3
    assert int((ckpt / "latest").read_text()) == stopped_at
    resumed = subprocess.run([*cmd, "--set", f"ckpt.load='{ckpt}'", "--set", f"train.iters={stopped_at + 2}"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(logs)][-2:] == [stopped_at + 1, stopped_at + 2]


def test_invalid_layout_under_torchrun_fails_fast_with_the_arithmetic(tmp_path):
    """Every rank rejects the layout before any collective: a message, never a hang."""
    config = write_config(tmp_path, iters=2)
    start = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "mtl.cli", "train", str(config),
         "--set", "parallel.tp=3"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "world size 2 is not divisible by tp*pp*cp = 3*1*1 = 3" in output, output[-3000:]
    assert time.monotonic() - start < 120


MTL = [str(BIN / "python"), "-m", "mtl.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_launcher_refuses_a_config_error_in_one_line_and_starts_nothing(tmp_path):
    """A deterministic config or data error is found once, before any process starts: one line,
    exit 2, never restarted (with --max-restarts 3, torchrun would run it four times)."""
    config = write_config(tmp_path, iters=2)
    for sets, needle in ((["model.hiden_size=3"], "--set: unknown key model.hiden_size (did you mean 'hidden_size'?)"),
                         (["parallel.tp=4"], "world size 2 is not divisible by tp*pp*cp = 4*1*1 = 4"),
                         (["data.dataset='gpt'", f"data.paths=['{tmp_path}/missing']"],
                          f"index file {tmp_path}/missing.idx does not exist")):
        start = time.monotonic()
        proc = subprocess.run([*MTL, "train", str(config), "--nproc-per-node", "2", "--max-restarts", "3",
                               *[arg for item in sets for arg in ("--set", item)]],
                              capture_output=True, text=True, timeout=120, env=ENV)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 2, output
        lines = output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], output
        assert time.monotonic() - start < 60


def test_launcher_trains_at_two_processes_and_logs_a_shared_warning_once(tmp_path):
    """``mtl train --nproc-per-node 2`` trains under torchrun (gloo); a resume with a changed
    setting, which every rank warns about, prints that warning once; --fresh into the run's own
    directory is refused in the parent."""
    config = write_config(tmp_path, iters=2)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    base = [*MTL, "train", str(config), "--nproc-per-node", "2", "--max-restarts", "1",
            "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{ckpt}'"]
    first = subprocess.run([*base, "--fresh"], capture_output=True, text=True, timeout=600, env=ENV)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert [r["step"] for r in read_metrics(logs)] == [1, 2] and (ckpt / "latest").read_text().strip() == "2"
    assert "dp 0/2" in first.stderr  # two data-parallel ranks
    again = subprocess.run([*base, "--fresh"], capture_output=True, text=True, timeout=120, env=ENV)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr, again.stderr[-3000:]
    assert len((again.stdout + again.stderr).strip().splitlines()) == 1
    resumed = subprocess.run([*base, "--set", "train.iters=3", "--set", "train.weight_decay=0.05"],
                             capture_output=True, text=True, timeout=600, env=ENV)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert output.count("with a changed setting: train.weight_decay: 0.1 -> 0.05") == 1, output[-3000:]
    assert output.count("resuming at iteration 2") == 1
    assert (ckpt / "latest").read_text().strip() == "3"


def test_launcher_passes_max_restarts_to_torchrun(tmp_path):
    """A rank SIGKILLed mid-run: torchrun (which the launcher became) restarts the job, which
    resumes from its last checkpoint and finishes."""
    config = write_config(tmp_path, iters=12)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    cmd = [*MTL, "train", str(config), "--nproc-per-node", "2", "--max-restarts", "1",
           "--set", f"logging.dir='{logs}'", "--set", f"ckpt.save='{ckpt}'", "--set", "ckpt.interval=4",
           "--set", "logging.progress='none'"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(logs) or read_metrics(logs)[-1]["step"] < 5:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "training did not reach step 5"
            time.sleep(0.02)
        victims = [pid for pid in children(proc.pid) if rank_of(pid) == 1]
        assert victims, "no rank 1 among the launcher's children"
        os.kill(victims[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert (ckpt / "latest").read_text().strip() == "12"
    assert "resuming at iteration 4" in output or "resuming at iteration 8" in output, output[-3000:]
