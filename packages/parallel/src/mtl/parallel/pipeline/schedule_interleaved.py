"""Interleaved 1F1B: each rank holds ``vpp`` model chunks; chunk k on rank r is virtual stage
``k * pp + r``, so a micro-batch visits every rank vpp times and the pipeline bubble shrinks
by a factor vpp.

Work is counted in "virtual micro-batches": ``num_micro_batches * vpp`` forwards (and as many
backwards) per rank. They are taken in groups of ``pp * vpp``: within a group the first pp
forwards use chunk 0 (micro-batches g*pp .. g*pp+pp-1), the next pp chunk 1, and so on;
backwards walk the chunks in reverse. This is why ``num_micro_batches`` must be a multiple
of pp.

Every step is one batched exchange (``p2p.communicate``) that may send an activation to the
next rank, a gradient to the previous one, and receive either; the peers wrap around so the
last rank's chunk k feeds the first rank's chunk k+1.
"""

from __future__ import annotations

from mtl.core.errors import ParallelError

from . import p2p
from .micro_step import GradSyncGate, backward_micro_batch, forward_micro_batch


def forward_backward_interleaved(
    forward_step,
    data_iterators: list,
    model_chunks: list,
    num_micro_batches: int,
    tensor_shape,
    dtype,
    topology,
    device,
    *,
    forward_only: bool = False,
    no_sync_func=None,
) -> list[dict]:
    """Run the schedule; returns each micro-batch's metrics on the last virtual stage."""
    pp, pp_rank, vpp = topology.pp, topology.pp_rank, len(model_chunks)
    if num_micro_batches % pp:
        raise ParallelError(
            f"the interleaved pipeline schedule needs num_micro_batches ({num_micro_batches}) to be "
            f"a multiple of pp ({pp}); change train.global_batch_size or micro_batch_size"
        )
    comm = dict(tensor_shape=tensor_shape, dtype=dtype, device=device)
    is_first_rank, is_last_rank = pp_rank == 0, pp_rank == pp - 1
    total = num_micro_batches * vpp
    group_size = pp * vpp

    def chunk_of(k: int, forward: bool) -> int:
        """Model chunk of virtual micro-batch k (Python's % keeps negative k in range)."""
        chunk = (k % group_size) // pp
        return chunk if forward else vpp - 1 - chunk

    def is_chunk_last_backward(k: int) -> bool:
        # The last backward of a chunk is in the last group, at the last of its pp slots.
        return k >= total - group_size and k % pp == pp - 1

    if forward_only:
        num_warmup = total
    elif num_micro_batches == pp:
        num_warmup = total  # nothing to interleave in steady state: all forwards, then all backwards
    else:
        # The first rank runs ahead by two steps per later rank plus one round of the other chunks.
        num_warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
    all_warmup = num_warmup == total
    num_steady = total - num_warmup

    losses: list[dict] = []
    inputs: list[list] = [[] for _ in range(vpp)]  # per chunk: received activations, oldest first
    outputs: list[list] = [[] for _ in range(vpp)]
    output_grads: list[list] = [[] for _ in range(vpp)]
    gate = GradSyncGate(None if forward_only else no_sync_func, num_chunks=vpp)

    def forward(k: int):
        chunk = chunk_of(k, forward=True)
        is_first_virtual = is_first_rank and chunk == 0
        if is_first_virtual:
            inputs[chunk].append(None)
        output = forward_micro_batch(
            forward_step,
            data_iterators[chunk],
            model_chunks[chunk],
            inputs[chunk][-1],
            is_first_stage=is_first_virtual,
            is_last_stage=is_last_rank and chunk == vpp - 1,
            num_micro_batches=num_micro_batches,
            losses=losses,
        )
        outputs[chunk].append(output)
        if forward_only:  # nothing will go backward: drop the references at once
            inputs[chunk].pop()
            outputs[chunk].pop()
        return output

    def backward(k: int):
        chunk = chunk_of(k, forward=False)
        if is_last_rank and chunk == vpp - 1:
            output_grads[chunk].append(None)  # the output is the loss itself
        if is_chunk_last_backward(k):
            gate.before_last_backward(chunk, is_last_of_rank=k == total - 1)
        return backward_micro_batch(inputs[chunk].pop(0), outputs[chunk].pop(0), output_grads[chunk].pop(0))

    def outgoing_activation(k: int, output):
        # The last virtual stage's output is the loss: it goes nowhere.
        return None if is_last_rank and chunk_of(k, forward=True) == vpp - 1 else output

    def outgoing_gradient(k: int, input_grad):
        return None if is_first_rank and chunk_of(k, forward=False) == 0 else input_grad

    try:
        if not is_first_rank:
            inputs[0].append(p2p.communicate(topology, recv_prev=True, **comm)[0])

        # ---- warm-up: forwards only (plus, at its end, the first gradient's receive) ---------
        for k in range(num_warmup):
            output = outgoing_activation(k, forward(k))
            next_chunk = chunk_of(k + 1, forward=True)
            # Chunk 0 of the first rank reads data, it receives nothing.
            recv_prev = not (is_first_rank and next_chunk == 0) and k < total - 1
            if k == num_warmup - 1 and not all_warmup:
                from_prev, from_next = p2p.communicate(
                    topology, send_next=output, recv_prev=recv_prev, recv_next=not is_last_rank, **comm
                )
                if from_next is not None:
                    output_grads[vpp - 1].append(from_next)
            else:
                from_prev, _ = p2p.communicate(topology, send_next=output, recv_prev=recv_prev, **comm)
            if recv_prev:
                inputs[next_chunk].append(from_prev)

        # ---- steady state: one forward and one backward per step ----------------------------
        for i in range(num_steady):
            forward_k, backward_k = i + num_warmup, i
            output = outgoing_activation(forward_k, forward(forward_k))
            input_grad = outgoing_gradient(backward_k, backward(backward_k))

            if is_first_rank:
                # The first rank is pp - 1 forwards ahead of the last one: the activation it
                # receives now was sent by the last rank for virtual micro-batch forward_k-(pp-1).
                sender_chunk = chunk_of(forward_k - (pp - 1), forward=True)
                recv_prev = sender_chunk != vpp - 1
                next_forward_chunk = sender_chunk + 1
            else:
                recv_prev = True
                next_forward_chunk = chunk_of(forward_k + 1, forward=True)
            if is_last_rank:
                # Symmetrically, the gradient arriving at the last rank comes from the first rank.
                sender_chunk = chunk_of(backward_k - (pp - 1), forward=False)
                recv_next = sender_chunk != 0
                next_backward_chunk = sender_chunk - 1
            else:
                recv_next = True
                next_backward_chunk = chunk_of(backward_k + 1, forward=False)
            if i == num_steady - 1:
                recv_prev = False  # every forward has been received

            from_prev, from_next = p2p.communicate(
                topology,
                send_next=output,
                send_prev=input_grad,
                recv_prev=recv_prev,
                recv_next=recv_next,
                **comm,
            )
            if recv_prev:
                inputs[next_forward_chunk].append(from_prev)
            if recv_next:
                output_grads[next_backward_chunk].append(from_next)

        # ---- cool-down: the remaining backwards ---------------------------------------------
        if not forward_only:
            if all_warmup and not is_last_rank:
                output_grads[vpp - 1].append(p2p.communicate(topology, recv_next=True, **comm)[1])
            for k in range(num_steady, total):
                input_grad = outgoing_gradient(k, backward(k))
                next_chunk = chunk_of(k + 1, forward=False)
                # The last chunk of the last rank computes its gradient from the loss.
                recv_next = not (is_last_rank and next_chunk == vpp - 1) and k < total - 1
                _, from_next = p2p.communicate(topology, send_prev=input_grad, recv_next=recv_next, **comm)
                if recv_next:
                    output_grads[next_chunk].append(from_next)
    finally:
        gate.close()
    return losses
