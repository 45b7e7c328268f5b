"""The first pass of ``RunConfig.resolve``: every derived value, computed once, here.

Each ``None`` field whose comment says *derived* is filled from the others; a value the user
gave is kept (the check pass, ``mtl.core.config_checks``, then says whether it fits). A
derivation that cannot be made (a division that does not come out even) raises here, naming
the key to set. Inputs are already known to be in range (``config_checks.check_values``).
"""

from __future__ import annotations

import math
from typing import Any

from mtl.core.config_hybrid import derive_hybrid
from mtl.core.config_pipeline import default_pipeline_split
from mtl.core.config_sections import ModelConfig, ParallelConfig, TrainConfig
from mtl.core.device_probe import runs_on_cuda
from mtl.core.errors import ConfigError
from mtl.core.log import get_logger

log = get_logger(__name__)


def derive(cfg: Any, world_size: int, tokenizer_vocab_size: int | None) -> None:
    """Fill every derived key of ``cfg`` (a ``RunConfig``) in place, in dependency order: the
    layout sizes the data-parallel group, which sizes the micro-batches; the backend's FP8 may
    turn compile off, which picks how cp ranks share keys and values."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    derive_hybrid(m, p)  # before the layout: its '|' cuts give the pipeline stages' layers
    _derive_layout(p, m, world_size)
    _derive_model(m, p, tokenizer_vocab_size)
    _derive_moe(m)
    _derive_masking(cfg.data)
    compile_unset = t.compile is None
    _derive_train(t, p)
    if compile_unset:
        _keep_fp8_eager(cfg)
    if p.cp_comm_type is None:
        # At cp = 2 the ring keeps its own block and the one it received for the backward, the
        # whole sequence's k/v, as the all-gather does, and the gather compiles with the layer;
        # above that the ring holds less, so it stays the default there.
        p.cp_comm_type = "all_gather" if t.compile and p.cp == 2 else "p2p"


# Megatron's pretrain_bert.py / pretrain_t5.py masking settings, per masked dataset
MASKING_DEFAULTS = {"bert": {"masking_max_ngram": 3, "masking_do_full_word": False,
                             "masking_use_geometric_distribution": False},
                    "t5": {"masking_max_ngram": 10, "masking_do_full_word": True,
                           "masking_use_geometric_distribution": True}}


def _derive_masking(d: Any) -> None:
    """Only for a masking dataset: another leaves the keys unset (and out of its config diffs)."""
    for name, value in MASKING_DEFAULTS.get(d.dataset, {}).items():
        if getattr(d, name) is None:
            setattr(d, name, value)


def _derive_layout(p: ParallelConfig, m: ModelConfig, world_size: int) -> None:
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = "
            f"{model_parallel}; launch a multiple of {model_parallel} processes"
        )
    p.world_size = world_size
    p.dp = world_size // model_parallel  # every rank not used by a model-parallel split replicates
    if p.sequence_parallel and p.tp == 1:
        p.sequence_parallel = False  # nothing to shard: sequence parallelism rides on TP
    if p.sharding is None:  # the Megatron spelling decides; check_values refused a contradiction
        p.sharding = "optimizer" if p.distributed_optimizer else "none"
    # every sharding from "optimizer" up runs the distributed optimizer (its state is sharded too)
    p.distributed_optimizer = p.sharding != "none"
    if p.pipeline_split is None:
        p.pipeline_split = default_pipeline_split(p, m)


def _derive_model(m: ModelConfig, p: ParallelConfig, tokenizer_vocab_size: int | None) -> None:
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads  # plain multi-head attention
    if m.head_dim is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size = {m.hidden_size} is not divisible by "
                f"model.num_attention_heads = {m.num_attention_heads}; set model.head_dim"
            )
        m.head_dim = m.hidden_size // m.num_attention_heads
    if m.ffn_hidden_size is None:
        # A gated MLP has three matrices instead of two; Megatron keeps the parameter count
        # of a 4h MLP by taking 2/3 of it, rounded down to a multiple of 64.
        if m.activation == "swiglu":
            m.ffn_hidden_size = int(4 * m.hidden_size * 2 / 3 / 64) * 64 or 64
        else:
            m.ffn_hidden_size = 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    # an encoder-decoder (t5) has as many decoder layers as encoder ones; other families have no
    # decoder stack, so the key stays unset there (and out of their config diffs)
    if m.num_decoder_layers is None and m.family == "t5":
        m.num_decoder_layers = m.num_layers
    if m.vocab_size is None:
        if tokenizer_vocab_size is None:
            raise ConfigError("model.vocab_size is not set and no tokenizer gave one")
        m.vocab_size = tokenizer_vocab_size
    # Pad so every TP rank holds an equal, kernel-friendly slice of the vocabulary.
    multiple = m.make_vocab_size_divisible_by * p.tp
    m.padded_vocab_size = int(math.ceil(m.vocab_size / multiple) * multiple)


def _derive_moe(m: ModelConfig) -> None:
    if m.num_experts == 0:
        if m.moe_layers is None:
            m.moe_layers = []  # a dense model: no MoE layer
        return
    if m.moe_layers is None:
        # Megatron's int --moe-layer-freq: layer i is MoE when i % N == 0
        m.moe_layers = [i for i in range(m.num_layers) if i % m.moe_layer_freq == 0]
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size  # an expert is a copy of the dense MLP unless told
    if m.moe_capacity_factor == 0:
        m.moe_capacity_factor = None  # 0 means dropless: one spelling of it downstream


def _derive_train(t: TrainConfig, p: ParallelConfig) -> None:
    if t.params_dtype is None:
        t.params_dtype = t.precision  # low-precision weights, fp32 main weights in the optimizer
    if t.compile is None:
        # on where the run uses CUDA (1.41x faster on the H100 reference model), off on CPU
        t.compile = runs_on_cuda(t.device)
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"micro_batch_size * dp = {t.micro_batch_size} * {p.dp} = {per_step}"
        )
    t.num_micro_batches = t.global_batch_size // per_step
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.iters  # the schedule spans the run
        if t.warmup_iters > t.lr_decay_iters:
            # A short run of a config written for a long one (--set train.iters=5) still runs:
            # warmup takes the whole run, as Megatron's warmup ends where the decay would.
            # Given both, the user meant them: check_train refuses the mismatch.
            log.info("train.warmup_iters = %d is longer than the run's %d iterations: warming up over "
                     "all %d (set train.lr_decay_iters to keep the schedule of a longer run)",
                     t.warmup_iters, t.lr_decay_iters, t.lr_decay_iters)
            t.warmup_iters = t.lr_decay_iters


def _keep_fp8_eager(cfg: Any) -> None:
    """``train.compile`` derived, FP8 on a backend whose FP8 modules do not compile
    (``Backend.fp8_compiles = False``, e.g. te): its modules stay eager, and graph breaks around
    each cost more than compile gains, unless the layers are captured (``train.cuda_graphs``),
    where the host's cost is gone. Only a registered backend is asked (a missing one is named
    by the check pass or when the model is built)."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    t = cfg.train
    backends = registry("backend")
    if t.fp8 == "none" or t.cuda_graphs or cfg.model.backend not in backends:
        return
    if not backends.get(cfg.model.backend).fp8_compiles:
        t.compile = False
