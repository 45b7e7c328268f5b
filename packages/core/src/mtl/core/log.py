"""Logging that says which rank speaks, and stays quiet on all ranks but one by default."""

from __future__ import annotations

import logging
import os


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not logging.getLogger("mtl").handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger("mtl")
        root.addHandler(handler)
        root.setLevel(os.environ.get("MTL_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logger
