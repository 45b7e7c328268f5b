"""Run one process as one rank of a larger job whose collectives move nothing.

torch's fake process group returns from every collective at once, without touching data, so
a single GPU runs exactly the work one rank of a layout does (its share of the compute, its
host time) with the communication taken out: the floor that layout reaches if every transfer
were hidden. Received tensors hold garbage (the loss may read nan); only times mean something.
``queue_time.py --as-rank`` and ``profile_step.py --as-rank`` use it.
"""

from __future__ import annotations

AS_RANK_HELP = "run as rank R of W processes whose collectives move nothing (benchmarks/gpu/fake_group.py)"


def join_fake_group(spec: str) -> None:
    """Initialise the fake process group as rank R of W (``spec`` "R/W") before mtl's setup,
    which then builds its groups over it as over a launcher's; this one process drives the GPU
    of local rank 0 (``mtl.parallel.testing.join_fake_group``)."""
    from mtl.parallel.testing import join_fake_group as join

    rank, _, world = spec.partition("/")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise SystemExit(f"--as-rank {spec!r}: give R/W with 0 <= R < W, e.g. 0/2")
    join(int(rank), int(world))
