"""Which process speaks for all: messages that are the same on every rank are logged once."""

from __future__ import annotations

import torch.distributed as dist


def is_first_rank() -> bool:
    """Rank 0 of the process group, or the only process when there is none."""
    return not dist.is_initialized() or dist.get_rank() == 0
