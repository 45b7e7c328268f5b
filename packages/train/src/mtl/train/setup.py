"""Everything a training run needs, built once from the resolved config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mtl.core.config import RunConfig, pipeline_num_layers
from mtl.core.log import get_logger
from mtl.core.model_protocol import LanguageModel, build_model
from mtl.core.plugins import registry
from mtl.parallel.distributed import init_distributed
from mtl.parallel.tensor_parallel.wgrad_fusion import enable_wgrad_fusion
from mtl.parallel.topology import Topology
from mtl.train.compile import compile_regions, inductor_options, set_async_tp
from mtl.train.precision import DTYPES
from mtl.train.resume import Start, check_checkpoint_dirs
from mtl.train.seeding import seed_everything

log = get_logger(__name__)


@dataclass
class Run:
    config: RunConfig
    topology: Topology
    device: torch.device
    tokenizer: Any
    chunks: list[torch.nn.Module]  # model chunks of this rank (vpp of them), DP-wrapped LanguageModels
    optimizer: Any
    datasets: dict[str, Any] = field(default_factory=dict)
    start: Start = Start(None, None, False)  # the checkpoint the run starts from (resume.starting_checkpoint)


def build_tokenizer(config: RunConfig):
    spec = registry("tokenizer").get(config.data.tokenizer)
    return spec.build(config.data.tokenizer_model)


def build_model_chunks(config: RunConfig, topology: Topology, device: torch.device) -> list[LanguageModel]:
    """This rank's model chunks: one per virtual pipeline stage, holding its global layers;
    each checked against the family contract (``mtl.core.model_protocol``) as it is built."""
    from mtl.parallel.pipeline import stage_layer_range

    backend = registry("backend").get(config.model.backend)
    family = registry("model family").get(config.model.family)
    p = config.parallel
    chunks = []
    for chunk in range(p.vpp):
        layer_range = stage_layer_range(
            pipeline_num_layers(config.model), topology, chunk,
            first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
            virtual_stage_layers=p.virtual_stage_layers,
        )
        first_virtual = topology.is_first_stage and chunk == 0
        last_virtual = topology.is_last_stage and chunk == p.vpp - 1
        model = build_model(
            family, config, topology, backend,
            pre_process=first_virtual, post_process=last_virtual, layer_range=layer_range,
        )
        chunks.append(cast_weights(model.to(device), config.train.params_dtype))
        if DTYPES[config.train.params_dtype] != torch.float32 and config.parallel.sharding in ("none", "optimizer"):
            # fp32 main_grad buffers: the weight-gradient GEMMs accumulate into them directly (ZeRO-2/3
            # keep no whole main_grad between micro-batches: each gradient is added into its bucket)
            enable_wgrad_fusion(model)
    set_async_tp(topology.tp_group if config.parallel.async_tp else None)  # process-wide: every run sets its own
    if config.train.compile:
        p, m = config.parallel, config.model
        # tokens per layer call on this rank: sequence parallelism splits them over tp, cp always
        tokens = m.seq_length * config.train.micro_batch_size // p.cp // (p.tp if p.sequence_parallel else 1)
        compile_regions(chunks, inductor_options(tokens_per_call=tokens, device=device))
    return chunks


def cast_weights(model: torch.nn.Module, params_dtype: str) -> torch.nn.Module:
    """bf16/fp16 weights (``train.params_dtype``) from the fp32 ones initialisation made, so
    every layout starts from the same rounded values; the optimizer keeps fp32 main copies.
    Non-trainable state (e.g. an FP8 backend's amax history) keeps its dtype."""
    dtype = DTYPES[params_dtype]
    if dtype != torch.float32:
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point():
                param.data = param.data.to(dtype)
    return model


def wrap_data_parallel(config: RunConfig, topology: Topology, chunks: list[torch.nn.Module]):
    from mtl.parallel.ddp import DataParallel

    p = config.parallel
    return [
        DataParallel(
            chunk, topology,
            bucket_size_mb=p.bucket_size_mb,
            overlap_grad_reduce=p.overlap_grad_reduce,
            sharding=p.sharding,
            dp_replicate=p.dp_replicate,
            overlap_param_gather=p.overlap_param_gather,
            # bf16/fp16 weights: gradients accumulate and reduce in fp32 (param.main_grad)
            grad_dtype=torch.float32,
        )
        for chunk in chunks
    ]


def build_optimizer(config: RunConfig, topology: Topology, ddp_chunks: list):
    from mtl.parallel.optimizer import build_optimizer as build

    t = config.train
    return build(
        ddp_chunks, topology,
        use_distributed_optimizer=config.parallel.distributed_optimizer,
        lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
    )


def dataset_sizes(config: RunConfig) -> dict[str, int]:
    t = config.train
    evals = t.iters // t.eval_interval + 1 if t.eval_interval else 0
    return {
        "train": t.iters * t.global_batch_size,
        "valid": max(evals * t.eval_iters * t.global_batch_size, t.global_batch_size),
        "test": max(t.eval_iters * t.global_batch_size, t.global_batch_size),
    }


def build_datasets(config: RunConfig, tokenizer, splits=("train", "valid")) -> dict[str, Any]:
    spec = registry("dataset").get(config.data.dataset)
    sizes = dataset_sizes(config)
    return {split: spec.build(config, tokenizer, split, sizes[split]) for split in splits}


def setup(config: RunConfig) -> Run:
    """Start the process group, resolve the config, build model, optimizer and data."""
    rank, world_size, device = init_distributed(config.train.device)
    tokenizer = build_tokenizer(config)
    config = config.resolve(world_size=world_size, tokenizer_vocab_size=tokenizer.vocab_size)
    start = check_checkpoint_dirs(config)  # before any compute
    if config.train.attention_kernel == "fa4":
        from mtl.parallel.backend_local.fa4 import activate_fa4

        activate_fa4(device)
    p = config.parallel
    topology = Topology.build(tp=p.tp, pp=p.pp, cp=p.cp, vpp=p.vpp, ep=p.ep, cp_comm_type=p.cp_comm_type)
    seed_everything(config.train.seed, topology, device)
    chunks = build_model_chunks(config, topology, device)
    ddp_chunks = wrap_data_parallel(config, topology, chunks)
    optimizer = build_optimizer(config, topology, ddp_chunks)
    datasets = build_datasets(config, tokenizer)
    if rank == 0:
        log.info("topology: %s", topology.describe())
    return Run(config, topology, device, tokenizer, ddp_chunks, optimizer, datasets, start)
