"""1F1B (one forward, one backward) pipeline schedule without interleaving.

Stage r of pp runs ``pp - r - 1`` warm-up forwards, then alternates one forward and one
backward until every micro-batch has gone forward, then runs the remaining backwards
(cool-down). At most ``pp - r`` micro-batches' activations are alive on stage r, instead of
all of them as in GPipe.

    stage 0:  F0 F1 F2 B0 F3 B1 B2 B3        (pp = 4, 4 micro-batches)
    stage 3:           F0 B0 F1 B1 F2 B2 F3 B3
"""

from __future__ import annotations

from torch import nn

from . import p2p
from .micro_step import GradSyncGate, backward_micro_batch, forward_micro_batch


def forward_backward_1f1b(
    forward_step,
    data_iterator,
    model_chunk: nn.Module,
    num_micro_batches: int,
    tensor_shape,
    dtype,
    topology,
    device,
    *,
    forward_only: bool = False,
    no_sync_func=None,
) -> list[dict]:
    """Run the schedule; returns each micro-batch's metrics on the last stage, [] elsewhere."""
    comm = dict(tensor_shape=tensor_shape, dtype=dtype, device=device)
    num_warmup = min(topology.pp - topology.pp_rank - 1, num_micro_batches)
    num_steady = num_micro_batches - num_warmup
    losses: list[dict] = []
    # Micro-batches gone forward whose backward is still to come, oldest first.
    pending_inputs: list = []
    pending_outputs: list = []
    gate = GradSyncGate(None if forward_only else no_sync_func, num_chunks=1)

    def forward(input_tensor):
        return forward_micro_batch(
            forward_step,
            data_iterator,
            model_chunk,
            input_tensor,
            is_first_stage=topology.is_first_stage,
            is_last_stage=topology.is_last_stage,
            num_micro_batches=num_micro_batches,
            losses=losses,
        )

    def backward(output_grad, is_last):
        if is_last:
            gate.before_last_backward(0, is_last_of_rank=True)
        return backward_micro_batch(pending_inputs.pop(0), pending_outputs.pop(0), output_grad)

    try:
        for _ in range(num_warmup):
            input_tensor = p2p.recv_forward(topology, **comm)
            output = forward(input_tensor)
            p2p.send_forward(output, topology, **comm)
            if not forward_only:
                pending_inputs.append(input_tensor)
                pending_outputs.append(output)

        input_tensor = p2p.recv_forward(topology, **comm) if num_steady > 0 else None
        for i in range(num_steady):
            last_steady = i == num_steady - 1
            output = forward(input_tensor)
            if forward_only:
                p2p.send_forward(output, topology, **comm)
                if not last_steady:
                    input_tensor = p2p.recv_forward(topology, **comm)
                continue
            # The gradient arriving now belongs to the oldest pending micro-batch, not to the
            # output just sent: the next stage is one step behind.
            output_grad = p2p.send_forward_recv_backward(output, topology, **comm)
            pending_inputs.append(input_tensor)
            pending_outputs.append(output)
            input_grad = backward(output_grad, is_last=last_steady and num_warmup == 0)
            if last_steady:
                p2p.send_backward(input_grad, topology, **comm)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_grad, topology, **comm)

        if not forward_only:
            for i in range(num_warmup):
                output_grad = p2p.recv_backward(topology, **comm)
                input_grad = backward(output_grad, is_last=i == num_warmup - 1)
                p2p.send_backward(input_grad, topology, **comm)
    finally:
        gate.close()
    return losses
