"""``train.cuda_graphs``: each transformer layer's training forward and backward captured as CUDA
graphs (``torch.cuda.make_graphed_callables``), so a micro-batch costs the host one replay per
layer and direction instead of launching every kernel (and, for eager backends such as
Transformer Engine, running their Python) again.

How it fits the rest:

- A graph reads and writes fixed addresses. The layer's inputs (the residual stream and the
  previous layer's MLP output it has not added yet, see ``TransformerBlock``) and the rotary
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
from mtl.models.gpt.transformer_block import defers_residual_add

log = get_logger(__name__)


class _LayerCall(nn.Module):
    """The call that is captured, the block's call of the layer as all tensors (what
    ``make_graphed_callables`` takes), with the layer's parameters as its own:
    ``(hidden, pending, *rotary) -> (hidden, mlp_out)`` for a layer that defers its residual add
    (``TransformerBlock``), else ``(hidden, *rotary) -> hidden``."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor):
        if defers_residual_add(self.layer):
            pending, *rotary = rest
            return self.layer(hidden, tuple(rotary) if rotary else None, None, pending)
        return self.layer(hidden, tuple(rest) if rest else None, None)


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
    """One layer's captured training call, and the eager layer for everything else."""

    def __init__(self, layer: nn.Module, graphed: Callable, sample: torch.Tensor):
        self.layer = layer
        self.graphed = graphed
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

    def check_addresses(self, key: str) -> None:
        """Fail loudly if a tensor the graphs read has moved (``param.data = ...``,
        ``module.to(...)``, ``load_state_dict(assign=True)`` after the capture): a replay would
        read freed memory."""
        now = _addresses(self.layer)
        moved = [name for name, address in self.addresses.items() if now.get(name) != address]
        if moved:
            raise RuntimeError(
                f"train.cuda_graphs: {', '.join(f'layers.{key}.{name}' for name in moved[:3])} moved after the "
                "layer was captured (a new tensor was assigned to it); the graphs would read freed memory. "
                "Change parameters in place (copy_), or set train.cuda_graphs = false")

    def __call__(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None, *pending: torch.Tensor):
        """The layer's call as the block makes it: ``pending`` where the layer defers its residual add."""
        for hook in self.replay_hooks:
            hook()
        return self.graphed(hidden, *pending, *(rotary or ()))


def _hooks(layer: nn.Module, name: str) -> list[Callable[[], None]]:
    return [getattr(module, name) for module in layer.modules() if callable(getattr(module, name, None))]


def capture_layer_graphs(model: nn.Module, micro_batch_size: int, seq_length: int) -> int:
    """Capture every transformer layer of ``model`` (a GPT-family ``LanguageModel`` on a CUDA
    device, in training mode) for inputs ``[seq_length, micro_batch_size, hidden]``; returns
    how many were captured. The model's block then replays them in training forwards. Called
    again (every step), it only checks that nothing the graphs read has moved, and returns 0."""
    block = model.layers
    if block.graphed_layers:
        for key, graphed in block.graphed_layers.items():
            graphed.check_addresses(key)
        return 0
    layers = list(block.values())
    if not layers:
        return 0
    first = next(layers[0].parameters())
    device, dtype = first.device, first.dtype
    hidden_size = model.config.model.hidden_size
    positions = torch.arange(seq_length, device=device).expand(micro_batch_size, seq_length)
    rotary = tuple(model.rotary(positions)) if model.rotary is not None else ()
    calls, samples = [], []
    generator = torch.Generator(device=device).manual_seed(0)
    for layer in layers:
        for hook in _hooks(layer, "before_graph_capture"):
            hook()
        calls.append(_LayerCall(layer))
        streams = [torch.randn(seq_length, micro_batch_size, hidden_size, device=device, dtype=dtype,
                               generator=generator).requires_grad_()
                   for _ in range(2 if defers_residual_add(layer) else 1)]  # hidden (, pending)
        samples.append((*streams, *(r.detach().clone() for r in rotary)))
    # allow_unused_input: the rotary tables need no gradient, and a weight whose gradient the
    # GEMM adds to main_grad itself may return none.
    # The warm-up runs on a side stream, where autograd warns that parameters' AccumulateGrad
    # nodes (kept by data parallelism's hooks) live on another; the warm-up's autograd.grad
    # accumulates nothing, and the replays run on the step's stream.
    warn = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if warn is not None:
        warn(False)
    try:
        graphed = torch.cuda.make_graphed_callables(tuple(calls), tuple(samples), allow_unused_input=True)
    finally:
        if warn is not None:
            warn(True)
    block.use_graphed_layers({
        key: GraphedLayer(layer, call, sample[0]) for key, layer, call, sample in zip(block.keys(), layers, graphed, samples)
    })
    log.info("train.cuda_graphs: %d layers captured for inputs %s", len(layers), tuple(samples[0][0].shape))
    return len(layers)
