"""Logging for runs of many processes: one line per message, from rank 0.

Under torchrun every rank runs the same code and would print the same message once per
process. The ``mtl`` handler therefore prints rank 0's records only; a message that differs
per rank (this rank's shard, its device, a failure only it saw) opts into every rank with
``extra=ALL_RANKS`` and is printed with its rank, and a message its caller already logs on
one chosen rank (the last pipeline stage, which holds the loss) passes ``extra=ONE_RANK``::

    log = get_logger(__name__)
    log.info("topology: %s", topology.describe())                    # once, from rank 0
    log.warning("rank-local cache miss: %s", path, extra=ALL_RANKS)  # "[rank 3] ..." from each rank
    if is_last_stage_writer:
        log.info("eval loss %.3f", loss, extra=ONE_RANK)             # once, from that rank

The rank is torchrun's ``RANK`` (no ``RANK``: one process, which prints everything). Other
handlers added to the ``mtl`` logger (tests that collect records) still see every record."""

from __future__ import annotations

import logging
import os

# ``extra=ALL_RANKS`` on a logging call: print it on every rank, prefixed with the rank
ALL_RANKS = {"all_ranks": True}
# ``extra=ONE_RANK``: the caller logs it on one rank only, whichever: print it there, as is
ONE_RANK = {"one_rank": True}


def _process_rank() -> int | None:
    """torchrun's rank of this process, or None when it runs alone (one process, no torchrun)."""
    rank = os.environ.get("RANK")
    if rank is None or os.environ.get("WORLD_SIZE", "1") == "1":
        return None
    return int(rank)


class RankFilter(logging.Filter):
    """Passes rank 0's records, any rank's ``ONE_RANK`` records, and every rank's ``ALL_RANKS``
    records with a ``[rank N]`` prefix."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _process_rank()
        everywhere = getattr(record, "all_ranks", False)
        record.rank_prefix = f"[rank {rank}] " if rank is not None and everywhere else ""
        return rank is None or rank == 0 or everywhere or getattr(record, "one_rank", False)


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    root = logging.getLogger("mtl")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(RankFilter())
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("MTL_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logger
