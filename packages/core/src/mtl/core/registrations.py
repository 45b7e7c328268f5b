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

    Optional fusion (``None``: the layer applies ``norm`` and the separate linear(s)). One
    layer spec serves every backend; where a norm feeds a linear, it asks for the fused leaf
    and falls back to the pair. The norm module is always built by ``norm`` and stays in the
    tree where the layer puts it (``input_norm``, ``pre_mlp_norm``), so parameter names,
    initialisation, checkpoints and converters are the same for every backend; the fused leaf
    receives it as ``norm=``, applies it itself (its parameters, ``eps``, and LayerNorm or
    RMSNorm by type) and must not register it as a submodule. Under sequence parallelism it
    also sums the norm's parameter gradients over TP, as the separate norm would.

    - ``norm_column_linear(input_size, output_size, *, norm, bias, init_std, topology,
      sequence_parallel=False, stride=1) -> nn.Module``: ``forward(x) == column_linear(norm(x))``
      with the column linear's parameters, names (``weight``, ``bias``) and layout.
    - ``norm_mlp(*, norm, hidden_size, ffn_hidden_size, activation, bias, init_std,
      output_init_std, topology, sequence_parallel) -> nn.Module``: the whole MLP block,
      ``forward(x) == fc2(act(fc1(norm(x))))`` with ``activation`` "gelu" or "swiglu"; its
      parameters are named and laid out as ``mtl.models.gpt.mlp.MLP``'s: ``linear_fc1.weight``
      ``[fc1_width/tp, h]`` (SwiGLU: ``[gate_local; up_local]``, recorded ``ParamLayout.tp_stride = 2``),
      ``linear_fc2.weight`` ``[h, ffn/tp]``, and their biases.

    FP8: ``fp8_recipes`` lists the ``train.fp8`` recipes the backend implements
    ("current", "delayed", "rowwise", "blockwise"); ``RunConfig.resolve`` refuses any other.
    When ``train.fp8`` is not "none" the layer passes ``fp8=Fp8Settings`` to
    ``column_linear``, ``row_linear``, ``norm_column_linear`` and ``norm_mlp`` of the
    transformer layers (never to the output layer, which stays in the compute precision), so a
    backend without FP8 never sees the keyword. FP8 state that must survive a restart (amax
    histories) is held in parameters with ``requires_grad = False``: the model-state
    checkpoint carries them, the optimizer and gradient buffers skip them.

    ``fp8_compiles`` (default True): False where the backend's FP8 modules cannot be traced by
    torch.compile and run eagerly between graph breaks, which costs more than compiling the
    rest gains; ``train.compile`` then defaults to off when ``train.fp8`` is set (an explicit
    ``train.compile = true`` is kept).

    ``check_config(config) -> None`` (optional) raises ``mtl.core.errors.ConfigError``, naming
    the keys and what to set instead, for settings the backend cannot run correctly; called by
    ``RunConfig.resolve`` (the config resolved up to the backend checks), before any work and
    whether or not the backend is installed.

    ``check_available() -> None`` (optional) raises ``mtl.core.errors.NotInstalledError`` with
    one line naming what to install when the backend cannot run in this environment (e.g.
    Transformer Engine missing); ``RunConfig.resolve`` calls it for the selected backend.
    """

    name: str
    column_linear: Callable[..., Any]
    row_linear: Callable[..., Any]
    norm: Callable[..., Any]
    core_attention: Callable[..., Any]
    description: str = ""
    norm_column_linear: Callable[..., Any] | None = None
    norm_mlp: Callable[..., Any] | None = None
    fp8_recipes: tuple[str, ...] = ()
    check_available: Callable[[], None] | None = None
    fp8_compiles: bool = True
    check_config: Callable[[Any], None] | None = None


FP8_RECIPES = ("current", "delayed", "rowwise", "blockwise")


@dataclass(frozen=True)
class Fp8Settings:
    """The resolved FP8 settings a backend's linears receive as ``fp8=`` (from ``train.fp8*``).

    - ``recipe``: "current" (per-tensor scale from this tensor's amax), "delayed" (per-tensor
      scale from the amax history of earlier calls), "rowwise" (a scale per row of each GEMM
      operand along its contraction dimension), "blockwise" (TE's 1x128/128x128 blocks).
    - ``format``: "e4m3" (e4m3 everywhere) or "hybrid" (e4m3 forward, e5m2 gradients).
    - ``amax_history_len``, ``amax_compute_algo`` ("max" over the history or "most_recent"),
      ``margin`` (scale = fp8_max / amax / 2**margin): delayed scaling only.
    - ``fast_accumulation``: the forward GEMM accumulates in Hopper's fast FP8 mode (no
      periodic promotion to fp32); the backward GEMMs always accumulate exactly.
    """

    recipe: str
    format: str = "hybrid"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    fast_accumulation: bool = True

    @classmethod
    def from_train_config(cls, train: Any) -> "Fp8Settings | None":
        """None when ``train.fp8 == "none"``."""
        if train.fp8 == "none":
            return None
        return cls(train.fp8, train.fp8_format, train.fp8_amax_history_len, train.fp8_amax_compute_algo,
                   train.fp8_margin, train.fp8_fast_accumulation)


@dataclass(frozen=True)
class ModelFamily:
    """A model family: how to build it, count its FLOPs and convert to and from other formats.

    - ``build(config: RunConfig, topology, backend: Backend, *, pre_process=True,
      post_process=True, layer_range=None) -> LanguageModel``: the whole model, or one pipeline
      (virtual) stage holding global layers ``[start, end)`` = ``layer_range``, with the
      embedding only if ``pre_process`` and the output head only if ``post_process``. What it
      returns must follow ``mtl.core.model_protocol.LanguageModel`` (forward with labels ->
      per-token fp32 loss, ``set_input_tensor``, ``compile_units``, parameters tagged with
      ``init_kind`` ...); the trainer, ``mtl generate``, ``mtl convert`` and ``--dry-run``
      build through ``model_protocol.build_model``, which refuses a model missing a member.
      It must initialise from ``config.train.seed`` so every parallel layout starts from the
      same global weights (``mtl.models.initialization`` does this for ``GPTModel``), and it
      must build on the meta device (``--dry-run`` counts parameters from that model).
    - ``layer_spec(config, backend) -> ModuleSpec`` (optional): the spec of one transformer
      layer, for families built on ``mtl.models.gpt.GPTModel``; ``model_protocol.build_model``
      hands it to ``build`` as ``layer_spec=`` (``build_gpt`` takes it), so a gpt-like family
      supplies only this (``mtl.models.gpt.family.gpt_like_family`` also brings gpt's formulas).
    - ``flops_per_iteration(config) -> float`` (optional): model FLOPs of one training
      iteration (forward and backward, counted as Megatron counts them); the training loop's
      TFLOP/s and MFU and ``--dry-run`` use it, and omit them for a family without one.
    - ``layer_flops_per_iteration(config) -> list[float]`` (optional): each transformer layer's
      part of ``flops_per_iteration``, in layer order (the rest is the LM head's); ``--dry-run``
      shows each pipeline rank's share with it, and with both the pipeline stages are sized by
      FLOPs (``parallel.pipeline_split``).
    - ``activation_bytes_per_layer(config) -> float | list[float]`` (optional): activation memory
      of one layer for one micro-batch on one rank, for ``--dry-run``'s memory estimate; a list
      gives each layer's, in layer order, for a family whose layers differ (hybrid).
    - ``pipeline_layers(model_section) -> int`` (optional): how many layers the pipeline stages
      split, in model order; ``layer_range`` counts in them. Without it ``model.num_layers``
      (t5: its encoder layers, then its decoder layers).
    - ``pipeline_tensor_shape(config) -> tuple[int, ...]`` (optional): the shape of what one stage
      sends the next for one micro-batch (gpt's ``[s/cp(/tp), b, h]`` without it); a family whose
      stages carry more than one hidden state (t5: the encoder output beside the decoder's) packs
      them into this one tensor, and its gradient comes back the same way.
    - ``forward_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]`` (optional): the keyword
      arguments of the model's forward for one micro-batch of the family's dataset (its field
      names, e.g. BERT's ``text``, ``types``, ``padding_mask``; the trainer adds ``position_ids``).
      Without it the trainer passes ``input_ids=tokens``, ``position_ids`` and ``labels`` (gpt's).
    - ``loss(output, batch, topology) -> (loss, metrics)`` (optional): the last stage's output
      for one micro-batch reduced to its scalar loss, and a dict of scalar metrics holding
      ``"loss"`` (each averaged over micro-batches and data-parallel ranks and logged). Without
      it the output is the per-token loss, averaged over ``batch["loss_mask"]``. With it the last
      stage may return whatever it takes (e.g. a dict of per-token terms).
    - ``generate(model, prompt_ids, max_new_tokens, *, temperature, top_k, eod, seed) -> list[int]``
      (optional): ``mtl generate`` for a family whose output is an answer to the prompt (an
      encoder-decoder), printed alone; without it the prompt is continued by gpt's KV-cache
      sampling (``mtl.models.generate``) and printed with its continuation.
    - ``check_config(config) -> None`` (optional): raises ``mtl.core.errors.ConfigError`` naming
      the key and what to set, for settings the family cannot build or would ignore; called by
      ``RunConfig.resolve`` before any work (as ``Backend.check_config``).
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
    layer_spec: Callable[..., Any] | None = None
    flops_per_iteration: Callable[[Any], float] | None = None
    layer_flops_per_iteration: Callable[[Any], list[float]] | None = None
    activation_bytes_per_layer: Callable[[Any], float | list[float]] | None = None
    pipeline_layers: Callable[[Any], int] | None = None
    pipeline_tensor_shape: Callable[[Any], tuple] | None = None
    forward_inputs: Callable[[Any], dict] | None = None
    loss: Callable[..., Any] | None = None
    check_config: Callable[[Any], None] | None = None
    generate: Callable[..., Any] | None = None


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
