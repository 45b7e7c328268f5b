"""Expert parallelism: the token exchange between the ranks of an expert-parallel group."""

from mtl.parallel.expert_parallel.all_to_all import all_to_all, exchange_counts
from mtl.parallel.expert_parallel.token_exchange import TokenExchange

__all__ = ["TokenExchange", "all_to_all", "exchange_counts"]
