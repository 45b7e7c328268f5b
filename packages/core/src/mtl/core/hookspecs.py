"""Every mtl hook, declared once. The docstring of each hook is its contract.

All hooks are called with no arguments, once, when a registry is first asked for; each
implementation returns a list of records (see ``mtl.core.registrations``), and the registry
gathers all results. Names must be unique within a kind across all installed
distributions: a duplicate is an error naming both distributions.
"""

from __future__ import annotations

import pluggy

from mtl.core.registrations import (
    Backend,
    CheckpointFormat,
    CliCommand,
    DatasetSpec,
    ModelFamily,
    TokenizerSpec,
    TrainCallback,
)

PROJECT = "mtl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def mtl_backends() -> list[Backend]:
    """Return the layer backends this plugin provides (``local``, ``te``, ``fp8``, ...).

    A backend builds the leaves of a layer (linears, norm, core attention); the model family
    owns the tree. Selected by ``model.backend``. The exact call of each factory is in
    ``mtl.core.registrations.Backend``; in short:

    - required: ``column_linear``, ``row_linear`` (Megatron's column/row tensor-parallel
      contract, sequence-first ``[s, b, h]``, every split parameter's layout record giving its ``tp_split_dim``),
      ``norm`` and ``core_attention``;
    - optional fusion: ``norm_column_linear`` (norm + column linear, TE's LayerNormLinear) and
      ``norm_mlp`` (norm + the whole MLP, TE's LayerNormMLP). The layer spec asks for them
      where a norm feeds a linear and otherwise builds the separate pair; the norm module stays
      where the layer puts it, so parameter names never depend on the backend;
    - FP8: ``fp8_recipes`` (the ``train.fp8`` values it implements; ``resolve`` refuses the
      others) and the ``fp8=Fp8Settings`` keyword its transformer-layer linears then receive;
    - ``check_available()``: one clear line naming what to install when the backend cannot
      run here (``resolve`` calls it)."""


@hookspec
def mtl_model_families() -> list[ModelFamily]:
    """Return the model families this plugin provides (``gpt``, ...). Selected by
    ``model.family``; its converters serve ``mtl convert``.

    The contract (``mtl.core.registrations.ModelFamily`` has the exact calls):

    - ``build`` returns a module following ``mtl.core.model_protocol.LanguageModel``:
      ``forward(input_ids, position_ids=None, labels=None, inference_context=None)`` gives the
      per-token fp32 loss ``[b, s]`` with labels, logits ``[b, s, V/tp]`` without, and hidden
      states ``[s(/tp), b, h]`` on a stage without ``post_process``; ``set_input_tensor``,
      ``compile_units()``, ``pre_process`` / ``post_process`` and ``config``. Callers build
      through ``model_protocol.build_model``, which names the family and the missing member.
    - Parameters say how they start (``init_kind``, ``tag_init``) and how they are laid out
      (one ``mtl.parallel.param_layout.ParamLayout`` record: ``tp_split_dim`` / ``tp_stride``,
      ``expert_split_dim``, ``vocab_rows``, ...); initialisation, the checkpoint layout and
      data parallelism read these, not name patterns.
    - A gpt-like family reuses ``GPTModel`` and supplies only ``layer_spec(config, backend)``.
    - ``flops_per_iteration(config)`` feeds TFLOP/s, MFU and ``--dry-run``, and
      ``layer_flops_per_iteration(config)`` (each layer's part) ``--dry-run``'s pipeline shares;
      core holds no family's formula. Parameter counts come from the model built on the meta device."""


@hookspec
def mtl_tokenizers() -> list[TokenizerSpec]:
    """Return the tokenizers this plugin provides. Selected by ``data.tokenizer`` (its file by
    ``data.tokenizer_model``) and by ``mtl preprocess``."""


@hookspec
def mtl_datasets() -> list[DatasetSpec]:
    """Return the datasets this plugin provides (``gpt``, ``mock``). Selected by ``data.dataset``;
    built once per split with ``build(config, tokenizer, split, num_samples)``."""


@hookspec
def mtl_checkpoint_formats() -> list[CheckpointFormat]:
    """Return checkpoint storage formats (``zarr``), listed by ``mtl plugins``.

    ``ckpt.format`` names the one training saves and resumes with; a format keeps mtl.ckpt's
    directory layout (``latest``, ``iter_NNNNNNN`` and its metadata). ``mtl convert`` and
    ``mtl generate`` still read and write ``zarr`` through mtl.ckpt directly."""


@hookspec
def mtl_train_callbacks() -> list[TrainCallback]:
    """Return training callbacks (metric sinks). Enabled by name in ``logging.callbacks``
    (``logging.tensorboard = true`` adds ``tensorboard``); only the rank that writes metrics
    builds them."""


@hookspec
def mtl_cli_commands() -> list[CliCommand]:
    """Return click commands to add to the ``mtl`` command group."""
