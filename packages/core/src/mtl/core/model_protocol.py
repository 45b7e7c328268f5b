"""What a model family's ``build`` returns: the contract the trainer, the pipeline schedule,
generation and the checkpoint code rely on, written once here.

``LanguageModel`` is a ``typing.Protocol``: a family's module need not inherit from anything,
it must only have these members. ``check_model`` verifies them right after ``build`` (so a
family missing one fails at build time with its name, not deep inside a pipeline step), and
``tag_init`` / ``INIT_KINDS`` are the per-parameter metadata initialisation reads.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from mtl.core.errors import PluginError

# How initialisation fills a parameter (``param.init_kind``, set by the module that creates it):
# "normal": N(0, model.init_std); "residual_output": N(0, init_std / sqrt(2 * num_layers)),
# for the projections that write into the residual stream; "zeros" (biases); "ones" (norm gains).
INIT_KINDS = ("normal", "residual_output", "zeros", "ones")

# The keywords every caller passes to forward (the trainer: input_ids, position_ids, labels;
# generation: inference_context).
FORWARD_ARGUMENTS = ("input_ids", "position_ids", "labels", "inference_context")


@runtime_checkable
class LanguageModel(Protocol):
    """A model (or one pipeline stage of it) as a family's ``build`` returns it: an
    ``nn.Module`` with these members.

    - ``forward(input_ids, position_ids=None, labels=None, inference_context=None)``:
      ``input_ids`` ``[b, s]`` (``None`` on a stage without ``pre_process``, which starts from
      the tensor given to ``set_input_tensor``). On a stage with ``post_process`` it returns
      the per-token fp32 loss ``[b, s]`` when ``labels`` ``[b, s]`` are given (the trainer
      masks and averages it; padded vocabulary rows never enter it), else the logits
      ``[b, s, V/tp]``. A stage without ``post_process`` returns its hidden states
      ``[s(/tp), b, h]``, which the pipeline sends to the next stage. ``inference_context``
      (KV cache, from generation) holds the keys and values of earlier tokens; positions
      continue from its offset when ``position_ids`` is ``None``.
    - ``set_input_tensor(tensor)``: the hidden states a later pipeline stage starts from,
      called by the schedule before each ``forward``.
    - ``compile_units() -> list[nn.Module]``: the modules ``train.compile`` compiles, one
      region each (GPT: the transformer layers, which share one graph, and the final norm).
    - optional, ``gather_units() -> list[nn.Module]``: what ``parallel.sharding = "parameters"``
      (ZeRO-3) gathers as one, just before each call, in the order the forward calls them
      (GPT: the embedding, the ``compile_units()``, the output layer; a table tied to the
      embedding is in both its units). Without it the units are the ``compile_units()``; the
      parameters in no unit are gathered for the whole step (``gather_units_of``).
    - optional, ``capture_cuda_graphs(micro_batch_size) -> int``: capture the layers'
      training forward and backward as CUDA graphs (``train.cuda_graphs``; a family without
      it gets a clear error when the key is set).
    - ``pre_process`` / ``post_process``: whether this stage holds the embedding / the final
      norm, output layer and loss.
    - ``config``: the resolved ``RunConfig`` it was built from (generation reads
      ``config.model``).

    Its parameters: named by global position (``layers.{i}.…`` with ``i`` the layer's index
    in the whole model), so a checkpoint written by one pipeline split loads into another;
    each carries ``init_kind`` (one of ``INIT_KINDS``, see ``tag_init``) and, where it is not
    replicated, one layout record (``mtl.parallel.param_layout.ParamLayout``, set with
    ``set_param_layout``): a tensor-parallel one records ``tp_split_dim`` (and ``tp_stride``
    when it fuses strided parts); one holding this expert-parallel rank's block of experts
    records ``expert_split_dim`` (its gradients are then reduced over the ranks holding the
    same experts); a vocabulary table records ``vocab_rows``; the word embedding is
    ``embedding.word_embeddings.weight`` and the LM head ``output_layer.weight`` (a tied copy
    on a last stage records ``shared_embedding`` and, in ``tied_global_name``, the name of the
    parameter it copies). The checkpoint layout and initialisation read only these.
    """

    config: Any
    pre_process: bool
    post_process: bool

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
    ) -> torch.Tensor: ...

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None: ...

    def compile_units(self) -> list[nn.Module]: ...


PROTOCOL_MEMBERS = ("config", "pre_process", "post_process", "forward", "set_input_tensor", "compile_units")


def gather_units_of(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3's gather units of ``model``: its ``gather_units()``, else its ``compile_units()``,
    else none. DataParallel and the dry-run's memory estimate both read them here."""
    for method in ("gather_units", "compile_units"):
        units_of = getattr(model, method, None)
        if callable(units_of):
            return list(units_of())
    return []


def tag_init(param: nn.Parameter, kind: str) -> nn.Parameter:
    """Say how initialisation fills ``param`` (one of ``INIT_KINDS``); returns it."""
    if kind not in INIT_KINDS:
        raise PluginError(f"init_kind = {kind!r} is not one of {INIT_KINDS}")
    param.init_kind = kind
    return param


def check_model(model: Any, family: str) -> LanguageModel:
    """``model`` if it follows ``LanguageModel``; otherwise a ``PluginError`` naming the family
    and every missing member."""
    problems = [] if isinstance(model, nn.Module) else [f"it is a {type(model).__name__}, not a torch.nn.Module"]
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(model, name)]
    if missing:
        problems.append("it lacks " + ", ".join(missing))
    elif callable(model.forward):
        params = inspect.signature(model.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        absent = [name for name in FORWARD_ARGUMENTS if name not in params and not takes_any]
        if absent:
            problems.append("its forward takes no " + ", ".join(absent))
    if problems:
        raise PluginError(
            f"model family '{family}' built a model that does not follow mtl.core.model_protocol.LanguageModel: "
            + "; ".join(problems) + " (see docs/architecture.md, 'Model families')"
        )
    return model


def build_model(family: Any, config: Any, topology: Any, backend: Any, **stage: Any) -> LanguageModel:
    """``family.build(config, topology, backend, **stage)``, checked against ``LanguageModel``.
    ``stage``: ``pre_process``, ``post_process``, ``layer_range`` of a pipeline stage; a family
    record with a ``layer_spec`` also passes it (``build(..., layer_spec=...)``, as gpt's does)."""
    if getattr(family, "layer_spec", None) is not None:
        stage = {**stage, "layer_spec": family.layer_spec}
    return check_model(family.build(config, topology, backend, **stage), family.name)
