"""Where a run is, as a user sees it: plain lines when the output is not a terminal (tokens/s,
elapsed, ETA; no TFLOP/s on a CPU), a live rich display on a terminal (a real pseudo-terminal
here), every save's path; ``mtl train`` twice resumes, ``--fresh`` refuses a used directory;
``--help`` points to the config reference."""

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_piped_output_is_plain_lines_with_save_paths(mtl, ok, tiny_toml):
    out = ok(mtl("train", tiny_toml, "--set", "train.iters=3", "--set", "ckpt.interval=2"))
    lines = [line for line in out.splitlines() if line.startswith("step")]
    assert [line.split("|")[0].split()[1] for line in lines] == ["1/3", "2/3", "3/3"], out
    assert all("tok/s" in line and "elapsed" in line for line in lines), out
    assert "ETA" in lines[0] and "ETA" not in lines[-1]
    assert "TFLOP" not in out and "MFU" not in out  # a CPU run: tokens/s only
    assert out.count("saved checkpoint") == 2
    assert f"saved checkpoint {Path('ckpt') / 'iter_0000002'}" in out
    assert f"saved checkpoint {Path('ckpt') / 'iter_0000003'}" in out


def test_twice_resumes_and_fresh_needs_an_empty_directory(mtl, ok, clean_error, tiny_toml, workdir):
    ok(mtl("train", tiny_toml))
    out = ok(mtl("train", tiny_toml, "--set", "train.iters=3"))
    assert [line.split("|")[0].split()[1] for line in out.splitlines() if line.startswith("step")] == ["3/3"]
    clean_error(mtl("train", tiny_toml, "--fresh"), "ckpt.save = ckpt already holds checkpoints",
                "latest iteration 3", "--fresh")
    out = ok(mtl("train", tiny_toml, "--fresh", "--set", "ckpt.save='other'"))
    assert "step      1/2" in out and (workdir / "other" / "latest").read_text().strip() == "2"


def test_help_points_to_the_config_reference(mtl, ok):
    out = ok(mtl("train", "--help"))
    assert "docs/config.md" in out and "--fresh" in out and "Ctrl-C" in out


def test_a_terminal_shows_a_live_display(tiny_toml, workdir):
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "150", "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(BIN / "mtl"), "train", str(tiny_toml), "--set", "train.iters=3"],
                            stdout=slave, stderr=slave, stdin=slave, cwd=workdir, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    screen = b"".join(chunks).decode(errors="replace")
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert "━" in plain  # the bar
    assert re.search(r"step 3/3 .*loss \d+\.\d+ +[\d,]+ tok/s", plain), plain[-2000:]
    assert "ETA" in plain and "\r" in screen  # redrawn in place, not a line per step
    assert "saved checkpoint ckpt/iter_0000003" in plain
    assert "TFLOP" not in plain


def test_async_saves_say_when_they_start_and_when_they_are_committed(mtl, ok, tiny_toml):
    out = ok(mtl("train", tiny_toml, "--set", "train.iters=3", "--set", "ckpt.interval=2",
                 "--set", "ckpt.async_save=true"))
    lines = [line for line in out.splitlines() if "checkpoint" in line]
    assert lines == [f"saving checkpoint {Path('ckpt') / 'iter_0000002'} in the background",
                     f"saved checkpoint {Path('ckpt') / 'iter_0000002'}",
                     f"saving checkpoint {Path('ckpt') / 'iter_0000003'} in the background",
                     f"saved checkpoint {Path('ckpt') / 'iter_0000003'}"], out
