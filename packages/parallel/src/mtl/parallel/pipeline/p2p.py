"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Every exchange goes through one ``batch_isend_irecv`` call holding up to four operations:

    send activation -> next stage     receive activation <- previous stage
    send gradient   -> previous stage receive gradient   <- next stage

Both neighbours post matching operations in the same call, so a rank that sends its
activation forward while waiting for a gradient from the same neighbour never blocks it
(the deadlock of a blocking ``send`` followed by ``recv`` on both sides).

Operations are always listed activations first, gradients second. With pp = 2, or when the
interleaved schedule wraps from the last rank back to the first, "next" and "previous" are the
same rank, and two messages travel between one pair of ranks in the same call; NCCL and gloo
match such messages in the order they are posted, and this fixed order makes both sides post
them identically (activation before gradient).

Peers wrap around (``topology.pp_peer``): the interleaved schedule sends the last rank's
output of chunk k to the first rank's chunk k+1. The schedules decide when a peer takes part;
the functions here only move tensors. Every tensor has the fixed ``tensor_shape`` of one
micro-batch (``[s, b, h]``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from mtl.core.errors import ParallelError

# Process groups that have already run one collective with all their ranks (see
# ``ensure_pp_group_ready``). Held, not just their ids, so a new group cannot reuse an id.
_ready_groups: list = []


def ensure_pp_group_ready(topology) -> None:
    """Run one collective on the pipeline group before its first batched p2p call.

    NCCL creates its communicator lazily; a first ``batch_isend_irecv`` that involves only
    two of the group's ranks is undefined behaviour (see the torch docs of that function).
    Every rank of the pipeline calls the schedule at the same time, so one all-reduce at its
    start is safe and makes every later pairwise exchange valid."""
    group = topology.pp_group
    if group is None or any(group is ready for ready in _ready_groups):
        return
    device = _group_device(group)
    token = torch.zeros(1, device=device)
    dist.all_reduce(token, group=group)
    _ready_groups.append(group)


def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_tensor_shape(tensor: torch.Tensor, tensor_shape: Sequence[int], what: str) -> None:
    """Refuse a tensor whose shape differs from the schedule's fixed micro-batch shape."""
    if tuple(tensor.shape) != tuple(tensor_shape):
        raise ParallelError(
            f"pipeline {what} has shape {tuple(tensor.shape)} but the schedule was given "
            f"tensor_shape={tuple(tensor_shape)}; every stage must emit [s, b, h] of that shape "
            f"(pass the sequence-first shape of one micro-batch, [s/tp, b, h] with sequence parallel)"
        )


def communicate(
    topology,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One batched exchange with the neighbours; returns (from_prev, from_next).

    ``send_next`` is an activation for the next stage, ``send_prev`` a gradient for the
    previous one. ``recv_prev`` asks for an activation from the previous stage, ``recv_next``
    for a gradient from the next one. Received activations require grad, so their ``.grad``
    after backward is the gradient to send back."""
    group = topology.pp_group
    if group is None:
        raise ParallelError(
            "pipeline p2p needs pp > 1: this topology has a single pipeline stage "
            f"({topology.describe()}); use the no-pipelining schedule"
        )
    next_rank, prev_rank = topology.pp_peer(1), topology.pp_peer(-1)
    from_prev = from_next = None
    activation_ops: list[dist.P2POp] = []
    gradient_ops: list[dist.P2POp] = []
    if send_next is not None:
        check_tensor_shape(send_next, tensor_shape, "activation sent forward")
        activation_ops.append(dist.P2POp(dist.isend, _contiguous(send_next, dtype), next_rank, group))
    if recv_prev:
        from_prev = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)
        activation_ops.append(dist.P2POp(dist.irecv, from_prev, prev_rank, group))
    if send_prev is not None:
        check_tensor_shape(send_prev, tensor_shape, "gradient sent backward")
        gradient_ops.append(dist.P2POp(dist.isend, _contiguous(send_prev, dtype), prev_rank, group))
    if recv_next:
        from_next = torch.empty(tuple(tensor_shape), dtype=dtype, device=device)
        gradient_ops.append(dist.P2POp(dist.irecv, from_next, next_rank, group))
    ops = activation_ops + gradient_ops
    if ops:
        # On NCCL, wait() makes the current (compute) stream wait for the exchange on NCCL's
        # stream, without blocking the host: the received tensors are ready for every kernel
        # queued after it, and the sent ones stay alive until the exchange has read them (the
        # process group holds them). No device synchronisation, so the host keeps queueing the
        # next micro-batch while the GPU works (Megatron synchronises here for PyTorch versions
        # older than ours).
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return from_prev, from_next


def _contiguous(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.dtype != dtype:
        raise ParallelError(
            f"pipeline tensor has dtype {tensor.dtype} but the schedule was given dtype={dtype}; "
            "pass the dtype the stages emit (e.g. torch.bfloat16 under bf16 training)"
        )
    return tensor.detach().contiguous()


# ---- the named exchanges of the schedules (Megatron's vocabulary) -------------------------


def recv_forward(topology, tensor_shape, dtype, device) -> torch.Tensor | None:
    """Activation from the previous stage; None on the first stage."""
    if topology.is_first_stage:
        return None
    return communicate(topology, recv_prev=True, tensor_shape=tensor_shape, dtype=dtype, device=device)[0]


def recv_backward(topology, tensor_shape, dtype, device) -> torch.Tensor | None:
    """Gradient of this stage's output from the next stage; None on the last stage."""
    if topology.is_last_stage:
        return None
    return communicate(topology, recv_next=True, tensor_shape=tensor_shape, dtype=dtype, device=device)[1]


def send_forward(output, topology, tensor_shape, dtype, device) -> None:
    """Activation to the next stage; nothing on the last stage."""
    if not topology.is_last_stage:
        communicate(topology, send_next=output, tensor_shape=tensor_shape, dtype=dtype, device=device)


def send_backward(input_grad, topology, tensor_shape, dtype, device) -> None:
    """Gradient of this stage's input to the previous stage; nothing on the first stage."""
    if not topology.is_first_stage:
        communicate(topology, send_prev=input_grad, tensor_shape=tensor_shape, dtype=dtype, device=device)


def send_forward_recv_backward(output, topology, tensor_shape, dtype, device) -> torch.Tensor | None:
    """Send an activation forward and, in the same batch, receive the gradient of an earlier one."""
    if topology.is_last_stage:
        return None
    return communicate(
        topology, send_next=output, recv_next=True, tensor_shape=tensor_shape, dtype=dtype, device=device
    )[1]


def send_backward_recv_forward(input_grad, topology, tensor_shape, dtype, device) -> torch.Tensor | None:
    """Send a gradient backward and, in the same batch, receive the next activation."""
    if topology.is_first_stage:
        return None
    return communicate(
        topology, send_prev=input_grad, recv_prev=True, tensor_shape=tensor_shape, dtype=dtype, device=device
    )[0]
