"""Expert parallelism: the token exchange between the ranks of an expert-parallel group."""

from mtl.parallel.expert_parallel.all_to_all import all_to_all, exchange_counts

__all__ = ["all_to_all", "exchange_counts"]
