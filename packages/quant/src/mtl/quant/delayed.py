"""Delayed scaling's bookkeeping as two ``torch.library`` ops, so that it compiles.

What a call does depends on things only known when it runs: whether autograd is running a
backward (then a forward is an activation-checkpointing recompute and must reuse the scales
its original forward used), and which of this layer's earlier forwards are still waiting for
their backward. Written as Python in the traced code, dynamo graph-broke on
``torch._C._current_graph_task_id()`` and recompiled on every call (a per-call counter and a
dict of pending scales in the guards), until it gave up at its recompile limit. Here the
decision and that state live inside two opaque ops, run as they are at run time under
torch.compile as in eager:

- ``mtl::fp8_delayed_forward_scales``: the (input, weight) scales of a forward. In a recompute
  (a backward is running and a forward of this layer is pending) the oldest pending forward's
  scales, first in first out, recording nothing. Otherwise from the history (its max or most
  recent entry; the call's own amax while it is empty); a training forward then records its
  amaxes and becomes pending. It returns a token (a CPU int64 scalar) naming the forward.
- ``mtl::fp8_delayed_grad_scale``: the output gradient's scale in that forward's backward,
  recording the gradient's amax; the forward stops being pending (its recompute, if any, has
  run before: autograd unpacks the saved tensors first).

The history is the layer's ``fp8_amax_history`` parameter (both ops declare the mutation);
the pending scales are process state keyed by the layer's ``fp8_key`` (a CPU int64 scalar, an
input of the graph rather than a constant, so all layers share one compiled graph). Amaxes
arrive already reduced over TP and data/context parallelism; a recompute reduces them too
(every rank recomputes the same forwards) and ignores them.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict

import torch

from mtl.quant.scaling import E4M3, scale_from_amax

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2

_pending: dict[int, OrderedDict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # layer key -> token -> scales
_tokens = itertools.count()
_layer_keys = itertools.count()
NO_TOKEN = -1  # a forward that recorded nothing (evaluation, no_grad, a recompute)


def new_layer_key(layer: object) -> torch.Tensor:
    """A layer's key for the pending scales (a plain CPU tensor: ``module.to`` leaves it). The
    layer's pending scales go with it: a forward that never ran its backward (an exception, a
    run stopped mid-step) would otherwise keep them for the life of the process."""
    key = next(_layer_keys)
    weakref.finalize(layer, _pending.pop, key, None)
    return torch.tensor(key, dtype=torch.int64)


def in_backward() -> bool:
    """True while autograd runs a backward pass (where activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


def _scale(history: torch.Tensor, current: torch.Tensor, use_max: bool, margin: int, dtype: torch.dtype):
    """The scale from one history row (most recent first), or from ``current`` while it is empty."""
    past = (history.max() if use_max else history[0]).float()
    return scale_from_amax(torch.where(past > 0, past, current), dtype, margin)


def _record(history: torch.Tensor, current: torch.Tensor) -> None:
    """``current`` enters the history row as its most recent entry."""
    history.copy_(torch.roll(history, 1))
    history[0] = current


@torch.library.custom_op("mtl::fp8_delayed_forward_scales", mutates_args=("history",))
def forward_scales(history: torch.Tensor, amax_x: torch.Tensor, amax_w: torch.Tensor, layer_key: torch.Tensor,
                   record: bool, use_max: bool, margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """history ``[3, L]``, amaxes (reduced) -> (scale_x, scale_w, token); see the module docstring."""
    pending = _pending.setdefault(int(layer_key), OrderedDict())
    if in_backward() and pending:  # activation recompute: the original forward's scales
        _, (scale_x, scale_w) = pending.popitem(last=False)
        return scale_x.clone(), scale_w.clone(), torch.tensor(NO_TOKEN)
    scale_x = _scale(history[INPUT], amax_x, use_max, margin, E4M3)
    scale_w = _scale(history[WEIGHT], amax_w, use_max, margin, E4M3)
    token = NO_TOKEN
    if record and not in_backward():
        _record(history[INPUT], amax_x)
        _record(history[WEIGHT], amax_w)
        token = next(_tokens)
        pending[token] = (scale_x, scale_w)
    return scale_x, scale_w, torch.tensor(token)


@forward_scales.register_fake
def _(history, amax_x, amax_w, layer_key, record, use_max, margin):
    return amax_x.new_empty(()), amax_w.new_empty(()), torch.empty((), dtype=torch.int64)


@torch.library.custom_op("mtl::fp8_delayed_grad_scale", mutates_args=("history",))
def grad_scale(history: torch.Tensor, amax_dy: torch.Tensor, layer_key: torch.Tensor, token: torch.Tensor,
               use_max: bool, margin: int, dtype: torch.dtype) -> torch.Tensor:
    """The output gradient's scale (recording its amax); the forward ``token`` is done."""
    _pending.get(int(layer_key), {}).pop(int(token), None)
    scale = _scale(history[GRAD_OUTPUT], amax_dy, use_max, margin, dtype)
    _record(history[GRAD_OUTPUT], amax_dy)
    return scale


@grad_scale.register_fake
def _(history, amax_dy, layer_key, token, use_max, margin, dtype):
    return amax_dy.new_empty(())
