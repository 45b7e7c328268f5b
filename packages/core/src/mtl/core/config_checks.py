"""The checks of ``RunConfig.resolve``: what the user gave, before anything is derived from it
(``check_values``), and the resolved layout, model and schedule, after (``check``). Every error
names the key and what to set instead; nothing here changes a value."""

from __future__ import annotations

import dataclasses
from typing import Any

from mtl.core.config_feature_checks import check_features
from mtl.core.config_hybrid import check_hybrid, check_hybrid_values
from mtl.core.config_pipeline import check_flops_split, pipeline_layer_split, pipeline_num_layers
from mtl.core.config_sections import CHOICES, SECTIONS, ModelConfig, ParallelConfig, TrainConfig
from mtl.core.errors import ConfigError


def check_values(cfg: Any) -> None:
    """Choices, signs and the sizes the derivations divide by, as given."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is None and getattr(type(getattr(cfg, section))(), key) is None:
            continue  # a derived key left unset: the derive pass fills it
        if value not in allowed:
            raise ConfigError(f"{dotted} = {value!r} is not one of {', '.join(allowed)}")
    for section in (m, p, t):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"{_key(section, f.name)} = {value} must not be negative")
    if cfg.ckpt.load_iteration is not None and cfg.ckpt.load_iteration < 0:
        raise ConfigError(f"ckpt.load_iteration = {cfg.ckpt.load_iteration} must not be negative "
                          "(a committed iteration of ckpt.save; unset it to resume from the latest)")
    _check_sharding_spellings(p)
    for name in ("tp", "pp", "vpp", "cp", "ep", "dp_replicate"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} = {getattr(p, name)} must be at least 1")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must be at least 1")
    if m.moe_layer_freq < 1:
        raise ConfigError(f"model.moe_layer_freq = {m.moe_layer_freq} must be at least 1")
    check_hybrid_values(m, p)
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("train.micro_batch_size and train.global_batch_size must be at least 1")


def check(cfg: Any, tokenizer_vocab_size: int | None) -> None:
    """The derived config: the layout fits the model, the model fits the tokenizer, and every
    optional feature can run with the rest (``check_features``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _check_layout(p, m)
    _check_model(m, p, tokenizer_vocab_size)
    _check_moe(m, p)
    check_hybrid(m, p)
    _check_train(t, p)
    check_features(cfg)


def _key(section: Any, name: str) -> str:
    for sname, cls in SECTIONS.items():
        if isinstance(section, cls):
            return f"{sname}.{name}"
    return name


def _check_layout(p: ParallelConfig, m: ModelConfig) -> None:
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp = {p.vpp} needs parallel.pp > 1")
    if p.ep > 1 and p.dp % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} must divide the data-parallel size {p.dp}")
    _check_sharding(p)
    if p.cp > 1 and m.seq_length % (2 * p.cp):
        raise ConfigError(
            f"model.seq_length = {m.seq_length} must be divisible by 2*cp = {2 * p.cp} "
            "(context parallelism splits the sequence into 2*cp load-balanced chunks)"
        )
    if p.sequence_parallel and m.seq_length % (p.tp * p.cp):
        raise ConfigError(
            f"model.seq_length = {m.seq_length} must be divisible by tp*cp = {p.tp * p.cp} "
            "for sequence parallelism"
        )
    if p.pipeline_split == "flops" and p.virtual_stage_layers is None:
        check_flops_split(pipeline_num_layers(m), p)  # the split itself needs the resolved model: resolve's end
    else:
        pipeline_layer_split(pipeline_num_layers(m), p)  # raises on a bad split


def _check_sharding_spellings(p: ParallelConfig) -> None:
    """``distributed_optimizer`` is Megatron's name for sharding = "optimizer": both given must agree."""
    if p.distributed_optimizer is None or p.sharding is None:
        return
    if p.distributed_optimizer and p.sharding == "none":
        raise ConfigError("parallel.distributed_optimizer = true contradicts parallel.sharding = 'none': "
                          "drop one of them (distributed_optimizer = true is sharding = 'optimizer')")
    if not p.distributed_optimizer and p.sharding != "none":
        raise ConfigError(f"parallel.distributed_optimizer = false contradicts parallel.sharding = '{p.sharding}' "
                          "(which shards the optimizer state too): drop parallel.distributed_optimizer")


def _check_sharding(p: ParallelConfig) -> None:
    """What the data-parallel sharding (``parallel.sharding``, ``dp_replicate``) cannot do."""
    ranks = p.dp * p.cp
    if p.overlap_param_gather and p.sharding == "none":
        raise ConfigError(
            "parallel.overlap_param_gather = true needs parallel.distributed_optimizer = true (or sharding = "
            "'gradients'): only the distributed optimizer all-gathers parameters after its step"
        )
    if p.overlap_param_gather and p.sharding == "parameters":
        raise ConfigError(
            "parallel.overlap_param_gather = true does nothing under parallel.sharding = 'parameters' (each "
            "layer's gather is already started one layer ahead): set it to false"
        )
    if p.sharding in ("gradients", "parameters") and not p.overlap_grad_reduce:
        raise ConfigError(
            f"parallel.overlap_grad_reduce = false does not work with parallel.sharding = '{p.sharding}' (its "
            "buckets are reduce-scattered and freed as backward fills them): set it to true"
        )
    if p.dp_replicate == 1:
        return
    if p.sharding == "none":
        raise ConfigError(f"parallel.dp_replicate = {p.dp_replicate} needs parallel.sharding other than 'none' "
                          "(without sharding every rank is already a replica): set sharding or dp_replicate = 1")
    if ranks % p.dp_replicate or ranks == p.dp_replicate:
        raise ConfigError(
            f"parallel.dp_replicate = {p.dp_replicate} must divide dp x cp = {ranks} and leave groups of at "
            f"least 2 ranks to shard over; use a divisor of {ranks} below it, or 1"
        )
    if p.ep > 1:
        raise ConfigError(f"parallel.dp_replicate = {p.dp_replicate} does not work with parallel.ep = {p.ep} yet "
                          "(experts shard over the expert-data-parallel group): set dp_replicate = 1")


def _check_model(m: ModelConfig, p: ParallelConfig, tokenizer_vocab_size: int | None) -> None:
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
            f"model.num_query_groups = {m.num_query_groups}"
        )
    if m.num_attention_heads % p.tp or m.num_query_groups % p.tp:
        raise ConfigError(
            f"parallel.tp = {p.tp} must divide model.num_attention_heads = "
            f"{m.num_attention_heads} and model.num_query_groups = {m.num_query_groups}"
        )
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(
            f"model.ffn_hidden_size = {m.ffn_hidden_size} is not divisible by parallel.tp = {p.tp}"
        )
    if m.activation == "relu2" and m.backend == "te":
        raise ConfigError("model.activation = 'relu2' is built by mtl's own MLPs and experts, not by "
                          "model.backend = 'te'; use gelu or swiglu, or model.backend = 'local'")
    if m.seq_length > m.max_position_embeddings and m.position_embedding == "learned":
        raise ConfigError(
            f"model.seq_length = {m.seq_length} exceeds model.max_position_embeddings = "
            f"{m.max_position_embeddings} (learned positions cannot extrapolate)"
        )
    if tokenizer_vocab_size is not None and m.vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab_size}); remove the key or raise it"
        )


# MoE keys without effect in a dense model -> their value when off
ROUTER_KEYS_OFF = {"moe_shared_expert_gate": False, "moe_capacity_factor": 0, "moe_router_expert_bias": False,
                   "moe_router_scaling_factor": 1.0, "moe_router_num_groups": 1, "moe_router_group_topk": 1,
                   "moe_router_bias_update_rate": 1e-3}


def _check_router_groups(m: ModelConfig) -> None:
    """The expert bias's update rate, the weights' scaling factor and group-limited routing
    (Megatron's group_limited_topk)."""
    if m.moe_router_bias_update_rate < 0:
        raise ConfigError(f"model.moe_router_bias_update_rate = {m.moe_router_bias_update_rate} must not be negative")
    if not m.moe_router_expert_bias and m.moe_router_bias_update_rate != ROUTER_KEYS_OFF["moe_router_bias_update_rate"]:
        raise ConfigError(f"model.moe_router_bias_update_rate = {m.moe_router_bias_update_rate} moves the expert bias: "
                          "set model.moe_router_expert_bias = true, or remove the key")
    if m.moe_router_expert_bias and m.moe_router != "sigmoid":
        # Megatron allows the aux-loss-free bias with sigmoid scores only: added to softmax
        # probabilities (which sum to one) it is not the rule those runs were tuned with
        raise ConfigError(f"model.moe_router_expert_bias = true needs model.moe_router = 'sigmoid' "
                          f"(have {m.moe_router!r}), as Megatron's --moe-router-enable-expert-bias does")
    if m.moe_router_expert_bias and m.moe_capacity_factor:
        # the update counts routed slots; with a capacity some are dropped after routing
        raise ConfigError(f"model.moe_router_expert_bias = true with model.moe_capacity_factor = "
                          f"{m.moe_capacity_factor}: the bias balances dropless routing; unset one of them")
    if not m.moe_router_scaling_factor > 0:
        raise ConfigError(f"model.moe_router_scaling_factor = {m.moe_router_scaling_factor} must be positive")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups < 1 or m.num_experts % groups:
        raise ConfigError(f"model.moe_router_num_groups = {groups} must be at least 1 and divide "
                          f"model.num_experts = {m.num_experts}")
    if groups == 1 and group_topk == 1:
        return  # no groups: every expert is a candidate
    if not 1 <= group_topk <= groups:
        raise ConfigError(f"model.moe_router_group_topk = {group_topk} must be between 1 and "
                          f"model.moe_router_num_groups = {groups}")
    per_group = m.moe_top_k // group_topk  # the scores a group is ranked by
    if per_group < 1 or per_group > m.num_experts // groups:
        raise ConfigError(
            f"model.moe_top_k // model.moe_router_group_topk = {m.moe_top_k} // {group_topk} = {per_group} experts "
            f"rank each group, which must be between 1 and the group's {m.num_experts // groups} experts"
        )
    if m.moe_top_k > group_topk * (m.num_experts // groups):
        raise ConfigError(f"model.moe_top_k = {m.moe_top_k} exceeds the {group_topk * (m.num_experts // groups)} "
                          f"experts of the model.moe_router_group_topk = {group_topk} groups a token may use")


def _check_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """The MoE keys: set only with experts, and dividing as the layout needs."""
    if m.num_experts == 0:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep = {p.ep} needs experts to split: set model.num_experts (it is 0)")
        if m.moe_layers:
            raise ConfigError(f"model.moe_layers = {m.moe_layers} needs model.num_experts > 0 (it is 0)")
        if m.moe_shared_expert_ffn_hidden_size:
            raise ConfigError(
                f"model.moe_shared_expert_ffn_hidden_size = {m.moe_shared_expert_ffn_hidden_size} needs "
                "model.num_experts > 0 (a dense model's MLP is model.ffn_hidden_size)"
            )
        for key, off in ROUTER_KEYS_OFF.items():  # set, they would do nothing
            if getattr(m, key) not in (off, None):
                raise ConfigError(f"model.{key} = {getattr(m, key)} needs model.num_experts > 0 (it is 0)")
        return
    _check_router_groups(m)
    if not 1 <= m.moe_top_k <= m.num_experts:
        raise ConfigError(
            f"model.moe_top_k = {m.moe_top_k} must be between 1 and model.num_experts = {m.num_experts}"
        )
    if m.num_experts % p.ep:
        raise ConfigError(
            f"model.num_experts = {m.num_experts} is not divisible by parallel.ep = {p.ep} "
            "(every expert-parallel rank holds the same number of experts)"
        )
    if m.bias:
        raise ConfigError(
            "model.bias = true with model.num_experts > 0: mtl's expert MLPs have no biases "
            "(nor have Mixtral's, Qwen-MoE's or DeepSeek's); set model.bias = false (model.qkv_bias stays available)"
        )
    if sorted(set(m.moe_layers)) != list(m.moe_layers) or any(
        not isinstance(i, int) or not 0 <= i < m.num_layers for i in m.moe_layers
    ):
        raise ConfigError(
            f"model.moe_layers = {m.moe_layers} must list distinct layer numbers in [0, "
            f"{m.num_layers}) in increasing order"
        )
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size"):
        size = getattr(m, key)
        if size % p.tp:
            raise ConfigError(f"model.{key} = {size} is not divisible by parallel.tp = {p.tp}")
    if m.moe_ffn_hidden_size < 1:
        raise ConfigError(f"model.moe_ffn_hidden_size = {m.moe_ffn_hidden_size} must be at least 1")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_ffn_hidden_size:
        raise ConfigError(
            "model.moe_shared_expert_gate = true needs a shared expert: set model.moe_shared_expert_ffn_hidden_size"
        )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} = {getattr(m, key)} must not be negative")
    if m.moe_capacity_factor is not None and m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor = {m.moe_capacity_factor} must not be negative")


def _check_train(t: TrainConfig, p: ParallelConfig) -> None:
    if t.params_dtype not in ("fp32", t.precision):
        raise ConfigError(
            f"train.params_dtype = {t.params_dtype!r} with train.precision = {t.precision!r}: the weights "
            f"are either '{t.precision}' (fp32 main weights in the optimizer) or 'fp32' (autocast)"
        )
    if p.vpp > 1 and t.num_micro_batches % p.pp:
        raise ConfigError(
            f"the interleaved pipeline schedule needs micro-batches per step "
            f"({t.num_micro_batches}) divisible by parallel.pp = {p.pp}"
        )
    if t.warmup_iters > t.lr_decay_iters:  # both given: an unset lr_decay_iters clamps the warmup instead
        raise ConfigError(
            f"train.warmup_iters = {t.warmup_iters} exceeds train.lr_decay_iters = {t.lr_decay_iters}: "
            "lower train.warmup_iters, raise train.lr_decay_iters, or unset it (then the warmup is "
            "clamped to train.iters)"
        )
    if not 0.0 <= t.wsd_decay_fraction <= 1.0:
        raise ConfigError(f"train.wsd_decay_fraction = {t.wsd_decay_fraction} must be in [0, 1]")
