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
    - ``norm(hidden_size, *, kind, eps) -> nn.Module``: kind is "layernorm" or "rmsnorm".
    - ``core_attention(*, num_heads, num_query_groups, head_dim, causal, dropout, topology)
      -> nn.Module`` whose forward takes q ``[b, s, heads, d]``, k and v ``[b, s, groups, d]``
      and returns ``[b, s, heads, d]`` (heads and groups are the local, per-TP-rank counts).
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
      post_process=True, layer_range=None) -> nn.Module``.
    - ``converters``: maps a format name ("hf") to an object with ``to_mtl(src_dir, dst_dir)``
      and ``from_mtl(src_dir, dst_dir)``.
    """

    name: str
    build: Callable[..., Any]
    converters: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class TokenizerSpec:
    """``build(model_path: str | None) -> Tokenizer`` (see mtl.data.tokenizers.base)."""

    name: str
    build: Callable[..., Any]
    needs_model_file: bool = False
    description: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """``build(config: RunConfig, tokenizer, split: str) -> torch Dataset`` of token samples."""

    name: str
    build: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class CheckpointFormat:
    """A storage format for sharded checkpoints: ``save(...)``/``load(...)`` as in mtl.ckpt."""

    name: str
    save: Callable[..., Any]
    load: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class TrainCallback:
    """``build(config: RunConfig) -> object`` with optional ``on_step(step, metrics)``,
    ``on_eval(step, metrics)``, ``close()``. Sinks such as TensorBoard or JSONL."""

    name: str
    build: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class CliCommand:
    """A click command added to the ``mtl`` group."""

    name: str
    command: Any
    description: str = ""
