"""One line per message under torchrun: rank 0 prints, other ranks print only what they mark
``ALL_RANKS`` (with their rank) or ``ONE_RANK`` (logged by that rank alone); a single process
prints everything, unprefixed."""

import os
import subprocess
import sys

import pytest

PROGRAM = """
import os
from mtl.core.log import ALL_RANKS, ONE_RANK, get_logger
log = get_logger("mtl.test")
log.warning("the same on every rank")
log.info("this rank's shard", extra=ALL_RANKS)
if os.environ.get("RANK") == "1":  # e.g. the last pipeline stage, which has the loss
    log.info("said by rank 1 only", extra=ONE_RANK)
"""


def stderr_lines(env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60,
                            env={**clean, **env})
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


@pytest.mark.parametrize("rank, expected", [
    ("0", ["WARNING mtl.test: the same on every rank", "[rank 0] INFO mtl.test: this rank's shard"]),
    ("1", ["[rank 1] INFO mtl.test: this rank's shard", "INFO mtl.test: said by rank 1 only"]),
])
def test_rank_zero_speaks_for_all_and_marked_messages_come_from_each_rank(rank, expected):
    assert stderr_lines({"RANK": rank, "WORLD_SIZE": "2"}) == expected


def test_one_process_prints_everything_without_a_rank():
    assert stderr_lines({}) == ["WARNING mtl.test: the same on every rank", "INFO mtl.test: this rank's shard"]
    assert stderr_lines({"RANK": "0", "WORLD_SIZE": "1"}) == stderr_lines({})
