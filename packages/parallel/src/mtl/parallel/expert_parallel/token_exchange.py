"""One MoE layer's token exchange over the expert-parallel group: rows sorted by global
expert go to the rank holding that expert, arrive sorted by local expert, and come back.

    exchange = TokenExchange(tokens_per_expert, ep_group)  # [E] counts of this rank's rows
    local = exchange.dispatch(rows)          # [N, h] sorted by global expert -> [M, h] sorted
                                             # by local expert (M = exchange.tokens_per_local_expert.sum())
    back = exchange.combine(expert_outputs)  # [M, h] -> [N, h], in ``rows``' order

Rank j of the group holds experts ``[j * E/ep, (j + 1) * E/ep)``, so rows sorted by global
expert are already grouped by destination rank. What arrives is grouped by source rank,
then local expert; the grouped expert GEMMs want local expert, then source rank, so
``dispatch`` applies that regrouping and ``combine`` its inverse before sending back. Both
are differentiable (the all-to-all's backward is the reverse exchange).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.parallel.expert_parallel.all_to_all import all_to_all, exchange_counts


def _block_regrouping(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``counts [a, b]`` sizes of row blocks stored a-major (``total`` rows, known on the host)
    -> the row indices that list the same rows b-major (every block kept whole, in order)."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts).t().reshape(-1)  # b-major block starts
    lengths = counts.t().reshape(-1)
    block_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=counts.device), lengths, output_size=total)
    first_out = torch.cumsum(lengths, 0) - lengths  # where each block starts in the output
    within = torch.arange(total, device=counts.device) - first_out[block_of_row]
    return starts[block_of_row] + within


class TokenExchange:
    def __init__(self, tokens_per_expert: torch.Tensor, group) -> None:
        """``tokens_per_expert [E]``: how many of this rank's rows go to each global expert;
        ``group``: the ep group (None: one rank, every expert local)."""
        ep = dist.get_world_size(group) if group is not None else 1
        self.group = group
        send = tokens_per_expert.view(ep, -1)  # [ep, E/ep]: rows for rank j's local experts
        recv = exchange_counts(send, group)  # [ep, E/ep]: rows from rank i for my local experts
        self.send_splits = send.sum(1).tolist()
        self.recv_splits = recv.sum(1).tolist()
        self.tokens_per_local_expert = recv.sum(0)  # [E/ep], on the counts' device
        self.regroup = _block_regrouping(recv, sum(self.recv_splits))  # (source, expert) order -> (expert, source) order
        self.inverse = torch.empty_like(self.regroup)
        self.inverse[self.regroup] = torch.arange(self.regroup.numel(), device=self.regroup.device)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [N, h]`` sorted by global expert -> ``[M, h]`` this rank's experts' rows,
        sorted by local expert (and by source rank within one)."""
        received = all_to_all(rows, self.recv_splits, self.send_splits, self.group)
        return received[self.regroup]

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """Expert ``outputs [M, h]`` (in ``dispatch``'s order) -> ``[N, h]`` in the order of
        the rows this rank dispatched."""
        return all_to_all(outputs[self.inverse], self.send_splits, self.recv_splits, self.group)
