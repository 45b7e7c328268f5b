"""mtl global tensors -> a Megatron-LM save directory Megatron-Core loads (weights only).

What ``dist_checkpointing.save`` writes for a GPTModel, written with PyTorch's distributed
checkpoint directly (no Megatron at export time): ``iter_NNNNNNN/`` holding ``.metadata`` +
``__0_0.distcp`` (one writer: DCP reassembles any TP/PP/EP layout on load), ``common.pt``
(``args``, ``iteration``, ``checkpoint_version``), ``metadata.json`` (the backend), and
``latest_checkpointed_iteration.txt`` beside it. Keys and global shapes are Megatron's
sharded keys (``names.py``): layers stacked along a leading axis when every layer is alike,
one key per layer when MoE and dense layers mix (Megatron's ``non_homogeneous_layers``);
experts grouped (``mlp.experts.experts.linear_fc1.weight [E, 2 * ffn, h]``); the vocabulary
padded with zero rows to ``padded_vocab_size`` for the target ``tp``; the linear modules' ``_extra_state``
objects Megatron asks for (None, as its local linears save them; ``spec="te"`` adds TE's
attention kernel's, and keeps an MoE layer's pre-MLP norm as ``pre_mlp_layernorm``).
Each tensor is built from the mtl tensors only when DCP writes it (``_LazyPlanner``).
Optimizer state is not exported: Megatron's distributed-optimizer layout is per parameter
bucket, which mtl's global moments do not fix; Megatron-LM resumes from weights with
``--no-load-optim``.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_megatron.dcp_reader import COMMON, METADATA_JSON
from mtl.models.convert_megatron.directory import RELEASE, TRACKER, iteration_folder
from mtl.models.convert_hf.common import as_source
from mtl.models.convert_megatron.megatron_args import SPECS, check_exportable, megatron_args, padded_vocab_size

# our per-layer suffix -> Megatron's (a dense layer; both specs)
EXPORT_NAMES: dict[str, str] = {
    "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_norm.bias": "mlp.linear_fc1.layer_norm_bias",
    "self_attention.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attention.q_norm.bias": "self_attention.q_layernorm.bias",
    "self_attention.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attention.k_norm.bias": "self_attention.k_layernorm.bias",
    "mlp.experts.linear_fc1.weight": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.linear_fc2.weight": "mlp.experts.experts.linear_fc2.weight",
    "mlp.shared_experts_gate.weight": "mlp.shared_experts.gate_weight",
}
# the TE spec's MoE layer has a norm module of its own before the router
TE_MOE_NAMES = {"pre_mlp_norm.weight": "pre_mlp_layernorm.weight", "pre_mlp_norm.bias": "pre_mlp_layernorm.bias"}
TOP_EXPORT = {"final_norm.weight": "decoder.final_layernorm.weight", "final_norm.bias": "decoder.final_layernorm.bias"}
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")

# the linear modules carrying ``_extra_state`` (None from Megatron's local linears; FP8
# metadata from TE's), by layer kind; the TE spec adds its attention kernel's and, where a TE
# version gives its norm modules one, theirs (an object the model does not ask for is ignored
# on load, a missing one fails it)
DENSE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
MOE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj")
SHARED_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
TE_ONLY_MODULES = ("self_attention.core_attention",)
TE_QK_NORMS = ("self_attention.q_layernorm", "self_attention.k_layernorm")
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


def megatron_layer_name(suffix: str, moe_layer: bool, spec: str) -> str:
    if moe_layer and spec == "te" and suffix in TE_MOE_NAMES:
        return TE_MOE_NAMES[suffix]
    return EXPORT_NAMES.get(suffix, suffix)


def megatron_tensor(suffix: str, tensor: torch.Tensor, gated: bool) -> torch.Tensor:
    """Our layout -> Megatron's: a gated fc1 ``[.., 2, ffn, h]`` -> ``[.., 2 * ffn, h]``
    (gate rows, then up rows), its bias ``[.., 2, ffn]`` -> ``[.., 2 * ffn]``."""
    if gated and suffix.endswith("linear_fc1.weight"):
        return tensor.flatten(-3, -2)
    if gated and suffix.endswith("linear_fc1.bias"):
        return tensor.flatten(-2, -1)
    return tensor


def export_checkpoint(m, source, dst_dir: str | Path, *, tp: int = 1, pp: int = 1, spec: str = "local",
                      iteration: int | str = RELEASE, **unknown: Any) -> list[str]:
    """Write ``dst_dir/iter_NNNNNNN`` (``release/`` for ``iteration = "release"``, what
    Megatron-LM loads as a converted model: no optimizer, iteration 0) and
    ``latest_checkpointed_iteration.txt``; returns the files written."""
    if unknown:
        raise ConfigError(f"unknown Megatron export options {sorted(unknown)}; known: tp, pp, spec, iteration")
    if spec not in SPECS:
        raise ConfigError(f"Megatron layer spec {spec!r} is not one of {', '.join(SPECS)}")
    if getattr(m, "family", "gpt") != "gpt":
        raise ConfigError(f"model.family = {m.family!r}: the Megatron exporter writes GPTModel checkpoints only")
    check_exportable(m, tp, pp)
    number = 0 if iteration == RELEASE else int(iteration)
    if iteration != RELEASE and number < 1:
        raise ConfigError(f"iteration = {iteration}: Megatron-LM loads iterations >= 1, or 'release'")
    dst_dir = Path(dst_dir)
    folder = dst_dir / iteration_folder(iteration)
    if folder.exists() and any(folder.iterdir()):
        raise CheckpointError(f"{folder} exists and is not empty; export into a new directory")
    plan = _megatron_plan(m, as_source(source), tp, spec)
    dtype = plan["embedding.word_embeddings.weight"][0].dtype
    state: dict[str, Any] = {key: meta for key, (meta, _) in plan.items()}
    state.update(_extra_states(m, spec))
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: assuming a single process"
        planner = _LazyPlanner({key: build for key, (_, build) in plan.items()})
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), planner=planner, no_dist=True)
    args = megatron_args(m, tp=tp, pp=pp, spec=spec, iteration=number,
                         bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": number}, folder / COMMON)
    (folder / METADATA_JSON).write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    (dst_dir / TRACKER).write_text(str(iteration))
    return sorted(str(p.relative_to(dst_dir)) for p in folder.rglob("*") if p.is_file()) + [TRACKER]


def _layer_kinds(m) -> tuple[set[int], bool]:
    """(the MoE layers, whether every layer is alike: Megatron then stacks them on one axis)."""
    moe_layers = set(m.moe_layers or [])
    return moe_layers, not moe_layers or moe_layers == set(range(m.num_layers))


Build = Callable[[], torch.Tensor]


def _megatron_plan(m, source, tp: int, spec: str) -> dict[str, tuple[torch.Tensor, Build]]:
    """Megatron's sharded key -> (meta tensor of its global shape, how to build it from the
    source's tensors), every mtl tensor placed once; nothing is read yet."""
    moe_layers, stacked = _layer_kinds(m)
    gated = m.activation == "swiglu"
    per_layer: dict[str, list[str | None]] = {}
    plan: dict[str, tuple[torch.Tensor, Build]] = {}
    for name in source.names():
        meta = source.meta(name)
        if name.startswith("layers."):
            _, layer, suffix = name.split(".", 2)
            key = megatron_layer_name(suffix, int(layer) in moe_layers, spec)
            if stacked:
                per_layer.setdefault(key, [None] * m.num_layers)[int(layer)] = name
            else:
                plan[f"decoder.layers.{layer}.{key}"] = (
                    megatron_tensor(suffix, meta, gated), lambda n=name, s=suffix: megatron_tensor(s, source.get(n), gated))
        elif name in VOCAB:
            rows = padded_vocab_size(meta.shape[0], m.make_vocab_size_divisible_by, tp)
            plan[name] = (meta.new_empty(rows, *meta.shape[1:]), lambda n=name, r=rows: _padded(source.get(n), r))
        else:
            plan[TOP_EXPORT.get(name, name)] = (meta, lambda n=name: source.get(n))
    for key, names in per_layer.items():
        if None in names:
            raise CheckpointError(f"the mtl checkpoint lacks decoder.layers.{key} for layers "
                                  f"{[i for i, n in enumerate(names) if n is None]}")
        suffix = names[0].split(".", 2)[2]
        meta = torch.stack([megatron_tensor(suffix, source.meta(n), gated) for n in names])
        plan[f"decoder.layers.{key}"] = (
            meta, lambda ns=names, s=suffix: torch.stack([megatron_tensor(s, source.get(n), gated) for n in ns]))
    if "embedding.word_embeddings.weight" not in plan:
        raise CheckpointError("the mtl checkpoint has no embedding.word_embeddings.weight; not a gpt model")
    return plan


def _padded(table: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary table with zero rows up to Megatron's padded size."""
    return torch.cat((table, table.new_zeros(rows - table.shape[0], *table.shape[1:])))


class _LazyPlanner(DefaultSavePlanner):
    """Plans from meta tensors and builds each tensor only when DCP writes it (one stored
    tensor in memory at a time, a layer stack for a stacked key); writes a ``BytesIO`` value's
    bytes as they are (as Megatron's save planner does), where the default planner would
    pickle the ``BytesIO`` object itself."""

    def __init__(self, builds: dict[str, Build]):
        super().__init__()
        self.builds = builds

    def lookup_object(self, index):
        build = self.builds.get(index.fqn)
        return build() if build is not None else super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def _sharded_object(obj: Any) -> io.BytesIO:
    """A Megatron ``ShardedObject``'s bytes as its torch_dist strategy stores them."""
    buffer = io.BytesIO()
    torch.save([obj], buffer)
    buffer.seek(0)
    return buffer


def _extra_states(m, spec: str) -> dict[str, io.BytesIO]:
    """``{key}/shard_{offset}_{shape}`` for each module's ``_extra_state`` ShardedObject
    (offsets: the layer axis when stacked, then the expert axis), holding None: a local
    linear's state, and TE's without FP8 history."""
    moe_layers, stacked = _layer_kinds(m)
    objects: dict[str, io.BytesIO] = {}
    if spec == "te":
        objects[_unique_key("decoder.final_layernorm._extra_state", (), ())] = _sharded_object(None)
    for layer in range(m.num_layers):
        moe = layer in moe_layers
        te_only = ()
        if spec == "te":
            te_only = TE_ONLY_MODULES + (TE_QK_NORMS if m.qk_norm else ()) + (("pre_mlp_layernorm",) if moe else ())
        modules = (MOE_MODULES + (SHARED_MODULES if m.moe_shared_expert_ffn_hidden_size else ())) if moe \
            else DENSE_MODULES
        prefix, offset, shape = ("decoder.layers.", (layer,), (m.num_layers,)) if stacked else \
            (f"decoder.layers.{layer}.", (), ())
        for module in modules + te_only:
            objects[_unique_key(f"{prefix}{module}._extra_state", offset, shape)] = _sharded_object(None)
        for module in EXPERT_MODULES if moe else ():
            for expert in range(m.num_experts):
                key = _unique_key(f"{prefix}{module}._extra_state", (*offset, expert), (*shape, m.num_experts))
                objects[key] = _sharded_object(None)
    return objects


def _unique_key(key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> str:
    offset, shape = offset or (0,), shape or (1,)  # an object outside any sharded axis is shard 0 of 1
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"
