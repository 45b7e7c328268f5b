"""The small frozen records that plugins hand to the registries through the hooks.

Each record has a ``name`` (unique within its kind) and callables; the registry adds which
distribution registered it. Fields typed ``Callable[..., Any]`` are documented with the
exact call they must accept, because core cannot import the packages that implement them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Backend:
    """Builds the leaves of a transformer layer; the tree is the model family's.

    Every factory receives resolved numbers (never a config to re-derive from) and the
    ``Topology`` of mtl.parallel (or ``None`` for a single process):

    - ``column_linear(input_size, output_size, *, bias, init_std, topology, gather_output=False,
      sequence_parallel=False, stride=1) -> nn.Module``: output dimension split over TP.
    - ``row_linear(input_size, output_size, *, bias, init_std, topology, input_is_parallel=True,
      sequence_parallel=False) -> nn.Module``: input dimension split over TP, output reduced.
    - ``norm(hidden_size, *, kind, eps, topology=None, sequence_parallel=False) -> nn.Module``,
      every argument passed by keyword; kind is "layernorm" or "rmsnorm". ``topology`` and
      ``sequence_parallel=True`` are passed only when the weight is replicated over TP but
      each rank normalises only part of the activations (sequence parallelism; QK-norm at
      tp > 1, each rank holding its own heads): the weight's gradients must then be summed
      over the TP group. A backend never run that way may accept just the first three.
    - ``core_attention(*, num_heads, num_query_groups, head_dim, causal, dropout, topology)
      -> nn.Module`` whose forward takes q ``[b, s_q, heads, d]``, k and v ``[b, s_kv, groups, d]``
      and returns ``[b, s_q, heads, d]`` (heads and groups are the local, per-TP-rank counts;
      ``s_q < s_kv`` when decoding with a KV cache, the causal mask then aligned to the end).
      The local backend also takes ``softmax_scale=None``.
    """

    name: str
    column_linear: Callable[..., Any]
    row_linear: Callable[..., Any]
    norm: Callable[..., Any]
    core_attention: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class ModelFamily:
    """A model family: how to build it and how to convert to and from other formats.

    - ``build(config: RunConfig, topology, backend: Backend, *, pre_process=True,
      post_process=True, layer_range=None) -> nn.Module``: the whole model, or one pipeline
      (virtual) stage holding global layers ``[start, end)`` = ``layer_range``, with the
      embedding only if ``pre_process`` and the output head only if ``post_process``. ``gpt``
      initialises from ``config.train.seed`` so every parallel layout starts from the same
      global weights.
    - ``converters``: maps a format name ("hf") to an object with
      ``to_mtl(hf_dir, *, tp=1) -> (model_section: dict, state: dict[str, Tensor])`` (the
      ``[model]`` config keys, and every parameter as a full global tensor with the vocabulary
      padded as the config resolves it at ``tp``) and
      ``from_mtl(model_cfg: ModelConfig, state: dict[str, Tensor], dst) -> None`` (writes the
      other format into directory ``dst``). Reading and writing mtl checkpoints is the
      caller's (``mtl convert`` in mtl-cli).
    """

    name: str
    build: Callable[..., Any]
    converters: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class TokenizerSpec:
    """``build(model_path: str | None) -> Tokenizer`` (see mtl.data.tokenizers.base);
    ``model_path`` is ``data.tokenizer_model``, required when ``needs_model_file``."""

    name: str
    build: Callable[..., Any]
    needs_model_file: bool = False
    description: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """``build(config: RunConfig, tokenizer, split: str, num_samples: int | None = None)
    -> torch Dataset`` of token samples. ``split`` is "train", "valid" or "test";
    ``num_samples`` is how many samples the run will draw (``None``: the dataset's natural
    size, e.g. one epoch)."""

    name: str
    build: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class CheckpointFormat:
    """A storage format for sharded checkpoints, with the calls of mtl.ckpt's ``zarr``:
    ``save(state, ckpt_dir, iteration, metadata=None, process_group=None) -> str`` and
    ``load(template_state, ckpt_dir, iteration=None, strict=True, verify=True)
    -> (state, metadata)``."""

    name: str
    save: Callable[..., Any]
    load: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class TrainCallback:
    """``build(config: RunConfig) -> object`` with ``on_step(step, metrics)``,
    ``on_eval(step, metrics)`` and ``close()``; the training loop calls all three, so each
    must exist. Sinks such as TensorBoard or JSONL."""

    name: str
    build: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class CliCommand:
    """A click command added to the ``mtl`` group."""

    name: str
    command: Any
    description: str = ""
