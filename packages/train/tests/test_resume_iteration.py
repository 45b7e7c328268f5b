"""Choosing the iteration a run resumes from, end to end through ``train()`` with real
checkpoints on disk: ``ckpt.load_iteration`` selects a committed one (and a damaged latest
iteration's error names that key); a deleted latest iteration falls back to the newest
committed one with one warning; a resume at another parallel layout is one INFO line, on
rank 0 only."""

import logging
import shutil
from pathlib import Path

import pytest

from mtl.ckpt.directory import committed_iterations
from mtl.core.config_io import load_config
from mtl.core.errors import CheckpointError
from mtl.parallel.testing import run_distributed
from mtl.train.loop import train
from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")] + ["train.iters=8", "train.warmup_iters=2"]


def run(overrides):
    return train(load_config(None, [*BASE, *overrides]), progress=False)


@pytest.fixture(scope="module")
def straight():
    return run([]).losses


@pytest.fixture
def saved(tmp_path) -> Path:
    """A run stopped at iteration 6, having saved 2, 4 and 6 (``latest`` names 6)."""
    ckpt = tmp_path / "ckpt"
    first = run([f"ckpt.save='{ckpt}'", "ckpt.interval=2", "train.exit_interval=6"])
    assert first.final_iteration == 6 and committed_iterations(str(ckpt)) == [2, 4, 6]
    return ckpt


def damage(ckpt: Path, iteration: int, what: str) -> None:
    """Damage one committed iteration: its metadata file, or the bytes of one array chunk."""
    folder = ckpt / f"iter_{iteration:07d}"
    if what == "metadata":
        (folder / "metadata.json").write_text("{ truncated")
        return
    chunk = next(p for p in sorted((folder / "arrays").rglob("*")) if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(b"\x00" * chunk.stat().st_size)


def command(ckpt: Path, *more: str) -> list[str]:
    return [f"ckpt.save='{ckpt}'", "ckpt.interval=2", *more]


@pytest.mark.parametrize("what", ["metadata", "array"])
def test_a_damaged_latest_iteration_names_load_iteration_which_resumes_another(saved, what, straight, mtl_log):
    damage(saved, 6, what)
    with pytest.raises(CheckpointError, match="corrupt") as info:
        run(command(saved))
    assert "set ckpt.load_iteration = N" in str(info.value) and "(committed: [2, 4])" in str(info.value)
    mtl_log.clear()
    resumed = run(command(saved, "ckpt.load_iteration=4"))
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    assert all(resumed.losses[step] == straight[step] for step in (5, 6, 7, 8))  # bit for bit
    # the damaged iteration 6 was saved over, and 'latest' follows this run
    assert committed_iterations(str(saved)) == [2, 4, 6, 8] and (saved / "latest").read_text().strip() == "8"
    assert not [r for r in mtl_log if r.levelno >= logging.WARNING]
    again = run(command(saved))  # the same command without the key: this run's latest, nothing to train
    assert again.losses == {} and again.final_iteration == 8


def test_a_deleted_latest_iteration_resumes_the_newest_committed_one(saved, straight, mtl_log):
    damage(saved, 6, "array")
    shutil.rmtree(saved / "iter_0000006")  # 'latest' still names 6
    mtl_log.clear()
    resumed = run(command(saved))
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    assert all(resumed.losses[step] == straight[step] for step in (5, 6, 7, 8))
    warnings = [r.getMessage() for r in mtl_log if r.levelno >= logging.WARNING]
    assert warnings == [f"{saved}/latest names iteration 6, which is not a committed checkpoint (its directory "
                        "is gone): starting from the newest committed one, iteration 4"]
    assert (saved / "latest").read_text().strip() == "8"


def test_load_iteration_must_be_a_committed_one(saved, tmp_path):
    logs = tmp_path / "logs"
    with pytest.raises(CheckpointError, match=r"ckpt.load_iteration = 5 is not a committed checkpoint in "
                                              r"ckpt.save = .*\(committed: \[2, 4, 6\]\)"):
        run(command(saved, "ckpt.load_iteration=5", f"logging.dir='{logs}'", "logging.callbacks=['jsonl']"))
    assert not logs.exists()  # refused before any step
    with pytest.raises(CheckpointError, match="no checkpoint to start from.*unset ckpt.load_iteration"):
        run([f"ckpt.save='{tmp_path / 'empty'}'", "ckpt.load_iteration=2"])


def test_load_iteration_of_ckpt_load_starts_a_new_directory_from_it(saved, tmp_path, straight):
    branch = tmp_path / "branch"
    resumed = run([f"ckpt.load='{saved}'", "ckpt.load_iteration=2", f"ckpt.save='{branch}'"])
    assert sorted(resumed.losses) == [3, 4, 5, 6, 7, 8]
    assert all(resumed.losses[step] == straight[step] for step in range(3, 9))
    assert committed_iterations(str(saved)) == [2, 4, 6] and (saved / "latest").read_text().strip() == "6"


def resume_and_keep_log(overrides: list[str]) -> list[tuple[int, str]]:
    """This rank's log records at INFO and above while resuming: (level, message)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logging.getLogger("mtl").addHandler(Keep(level=logging.INFO))
    run(overrides)
    return [(r.levelno, r.getMessage()) for r in records]


def test_a_layout_change_on_resume_is_one_info_line_on_rank_zero(tmp_path):
    ckpt = tmp_path / "ckpt"
    run([f"ckpt.save='{ckpt}'", "train.exit_interval=4"])
    ranks = run_distributed(resume_and_keep_log, 2, args=([f"ckpt.save='{ckpt}'", "parallel.tp=2"],))
    layout = [m for _, m in ranks[0] if "another layout" in m]
    assert layout == ["resuming at another layout (parallel.tp: 1 -> 2; parallel.world_size: 1 -> 2): weights and "
                      "optimizer state reshard; RNG streams re-seeded from (train.seed, iteration 4)"]
    assert [m for level, m in ranks[0] if level >= logging.WARNING] == []
    assert ranks[1] == []  # the other rank says nothing
