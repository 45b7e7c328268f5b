"""``train.cuda_graphs``: each transformer layer's training forward and backward captured as CUDA
graphs (``torch.cuda.make_graphed_callables``), so a micro-batch costs the host one replay per
layer and direction instead of launching every kernel (and, for eager backends such as
Transformer Engine, running their Python) again.

How it fits the rest:

- Applied from outside the model's code: each layer's call in the block (``layer_calls.py``)
  becomes a ``GraphedLayer``, which replays in training and calls the layer as before otherwise.
- A graph reads and writes fixed addresses. The layer's inputs (the residual stream and, under
  ``train.compile``, the previous layer's MLP output not added yet, ``residual_deferral.py``) and the rotary
  tables are copied into the graph's own input tensors at each replay; its outputs and input
  gradients live in the graphs' memory pool until the next replay. With one model replica per GPU and
  no pipeline (``_check_cuda_graphs`` in mtl.core.config), micro-batch ``i``'s backward ends
  before ``i + 1``'s forward starts, so one graph per layer and direction is enough.
- Parameters, ``main_grad`` buffers and the optimizer's writes keep their addresses (updates
  are in place), so replays see the new weights; every step checks that they have not moved
  (a tensor assigned over one is an error, not a replay over freed memory). Gradients leave the backward graph as
  tensors autograd hands to the parameters as usual: data parallelism's hooks run unchanged.
- A module whose forward keeps host-side state between steps says so with two methods:
  ``before_graph_capture()`` (called once, before the warm-up runs) and
  ``before_graph_replay()`` (called before every forward replay): the FP8 weight cache, for
  one, refreshes its FP8 copy in place there after an optimizer step.
- Capturing runs each layer forward and backward a few times on sample inputs. Their weight
  gradients may land in ``main_grad`` (gradient-accumulation fusion), which the training step
  zeroes before its first micro-batch; nothing else is changed.
- Evaluation, generation (a KV cache) and any input of another shape run the layer as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mtl.core.log import get_logger
from mtl.models.gpt.layer_calls import layer_calls
from mtl.models.gpt.residual_deferral import is_deferred

log = get_logger(__name__)


class _TensorCall(nn.Module):
    """A layer's call with tensors only (what ``make_graphed_callables`` takes), the call's
    module as its child (its parameters are the graphs' weights): ``(hidden, pending, *rotary)
    -> (hidden, mlp_out)`` for a deferred step (``residual_deferral.py``), else
    ``(hidden, *rotary) -> hidden``."""

    def __init__(self, call: Callable, module: nn.Module, deferred: bool):
        super().__init__()
        self.module = module
        self.__dict__["call"] = call  # the module's call (compiled in place or not), not a second child
        self.deferred = deferred

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor):
        if self.deferred:
            pending, *rotary = rest
            return self.call(hidden, pending, tuple(rotary) if rotary else None, None)
        return self.call(hidden, tuple(rest) if rest else None, None)


def _addresses(layer: nn.Module) -> dict[str, int]:
    """Where the layer's parameters and their ``main_grad`` buffers live: a graph reads them there."""
    found = {}
    for name, param in layer.named_parameters():
        found[name] = param.data_ptr()
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            found[f"{name}.main_grad"] = main_grad.data_ptr()
    return found


class GraphedLayer:
    """One layer's call in the block: its captured graphs in training forwards, the call it
    replaces for everything else (evaluation, generation, no grad, another input shape)."""

    def __init__(self, key: str, layer: nn.Module, call: Callable, graphed: Callable, sample: torch.Tensor):
        self.key, self.layer, self.call, self.graphed = key, layer, call, graphed
        self.shape, self.dtype = sample.shape, sample.dtype
        self.replay_hooks = _hooks(layer, "before_graph_replay")
        self.addresses = _addresses(layer)
        self._warned = False

    def matches(self, hidden: torch.Tensor) -> bool:
        if hidden.shape == self.shape and hidden.dtype == self.dtype:
            return True
        if not self._warned:
            log.warning("train.cuda_graphs: a layer input of shape %s (%s), not the captured %s (%s), runs eagerly",
                        tuple(hidden.shape), hidden.dtype, tuple(self.shape), self.dtype)
            self._warned = True
        return False

    def check_addresses(self) -> None:
        """Fail loudly if a tensor the graphs read has moved (``param.data = ...``,
        ``module.to(...)``, ``load_state_dict(assign=True)`` after the capture): a replay would
        read freed memory."""
        now = _addresses(self.layer)
        moved = [name for name, address in self.addresses.items() if now.get(name) != address]
        if moved:
            raise RuntimeError(
                f"train.cuda_graphs: {', '.join(f'layers.{self.key}.{name}' for name in moved[:3])} moved after the "
                "layer was captured (a new tensor was assigned to it); the graphs would read freed memory. "
                "Change parameters in place (copy_), or set train.cuda_graphs = false")

    def __call__(self, hidden: torch.Tensor, *rest):
        """The call as the block makes it: ``(hidden, [pending,] rotary, inference_context)``."""
        *pending, rotary, inference_context = rest
        if self.layer.training and inference_context is None and torch.is_grad_enabled() and self.matches(hidden):
            return self.replay(hidden, *pending, *(rotary or ()))
        return self.call(hidden, *rest)

    def replay(self, *tensors: torch.Tensor):
        for hook in self.replay_hooks:
            hook()
        return self.graphed(*tensors)


def _hooks(layer: nn.Module, name: str) -> list[Callable[[], None]]:
    return [getattr(module, name) for module in layer.modules() if callable(getattr(module, name, None))]


def capture_layer_graphs(model: nn.Module, micro_batch_size: int, seq_length: int) -> int:
    """Capture every transformer layer of ``model`` (a GPT-family ``LanguageModel`` on a CUDA
    device, in training mode) for inputs ``[seq_length, micro_batch_size, hidden]``; returns
    how many were captured. The block's layer calls replay them in training forwards from then
    on. Called again (every step), it only checks that nothing the graphs read has moved, and
    returns 0."""
    calls = layer_calls(model.layers)
    captured = [call for call in calls.calls if isinstance(call, GraphedLayer)]
    if captured:
        for graphed in captured:
            graphed.check_addresses()
        return 0
    if not calls.layers:
        return 0
    deferred = is_deferred(model.layers)
    first = next(calls.layers[0].parameters())
    device, dtype = first.device, first.dtype
    hidden_size = model.config.model.hidden_size
    positions = torch.arange(seq_length, device=device).expand(micro_batch_size, seq_length)
    rotary = tuple(model.rotary(positions)) if model.rotary is not None else ()
    tensor_calls, samples = [], []
    generator = torch.Generator(device=device).manual_seed(0)
    for layer, unit, call in zip(calls.layers, calls.units, calls.calls):
        for hook in _hooks(layer, "before_graph_capture"):
            hook()
        tensor_calls.append(_TensorCall(call, unit, deferred))
        streams = [torch.randn(seq_length, micro_batch_size, hidden_size, device=device, dtype=dtype,
                               generator=generator).requires_grad_()
                   for _ in range(2 if deferred else 1)]  # hidden (, pending)
        samples.append((*streams, *(r.detach().clone() for r in rotary)))
    graphed = _make_graphed(tensor_calls, samples)
    calls.calls = [GraphedLayer(key, layer, call, graph, sample[0])
                   for key, layer, call, graph, sample in zip(calls.keys, calls.layers, calls.calls, graphed, samples)]
    log.info("train.cuda_graphs: %d layers captured for inputs %s", len(graphed), tuple(samples[0][0].shape))
    return len(graphed)


def _make_graphed(tensor_calls: list[nn.Module], samples: list[tuple]) -> tuple:
    # allow_unused_input: the rotary tables need no gradient, and a weight whose gradient the
    # GEMM adds to main_grad itself may return none.
    # The warm-up runs on a side stream, where autograd warns that parameters' AccumulateGrad
    # nodes (kept by data parallelism's hooks) live on another; the warm-up's autograd.grad
    # accumulates nothing, and the replays run on the step's stream.
    warn = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if warn is not None:
        warn(False)
    try:
        return torch.cuda.make_graphed_callables(tuple(tensor_calls), tuple(samples), allow_unused_input=True)
    finally:
        if warn is not None:
            warn(True)
