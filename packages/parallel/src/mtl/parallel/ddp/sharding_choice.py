"""Which sharding ``DataParallel`` runs (``parallel.sharding``), its arguments checked first."""

from __future__ import annotations

from mtl.core.errors import ParallelError

SHARDINGS = ("none", "optimizer", "gradients", "parameters")  # parallel.sharding: ZeRO-0..3


def checked_sharding(sharding: str | None, use_distributed_optimizer: bool, bucket_size_mb: float,
                      overlap_param_gather: bool) -> str:
    """``DataParallel``'s sharding (None: "optimizer" with the distributed optimizer, else
    "none"), its arguments checked first."""
    sharding = sharding or ("optimizer" if use_distributed_optimizer else "none")
    if sharding not in SHARDINGS or (use_distributed_optimizer and sharding == "none"):
        raise ParallelError(f"DataParallel sharding = {sharding!r} (use_distributed_optimizer="
                            f"{use_distributed_optimizer}) must be one of {', '.join(SHARDINGS)}, "
                            "and not 'none' with the distributed optimizer (parallel.sharding)")
    if not bucket_size_mb > 0:
        raise ParallelError(f"DataParallel bucket_size_mb = {bucket_size_mb!r} must be > 0 (parallel.bucket_size_mb; "
                            "40 is a good default, smaller buckets start communication earlier)")
    if overlap_param_gather and sharding == "none":
        raise ParallelError("DataParallel(overlap_param_gather=True) needs use_distributed_optimizer=True "
                            "(parallel.overlap_param_gather needs parallel.distributed_optimizer): only the "
                            "distributed optimizer all-gathers parameters after its step")
    return sharding
