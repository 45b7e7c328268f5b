"""The run configuration: one dataclass per section, every derived value computed in ``resolve``.

Fields whose default is ``None`` and whose comment says *derived* are filled by
``RunConfig.resolve``; modules receive the resolved config and never re-derive anything.
This is the single place where, e.g., the gated-MLP width or the padded vocabulary is decided.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from mtl.core.errors import ConfigError
from mtl.core.torch_release import torch_release

CHOICES: dict[str, tuple[str, ...]] = {
    "model.normalization": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.position_embedding": ("learned", "rope"),
    "model.rope_scaling": ("none", "llama3"),
    "model.moe_router": ("softmax", "sigmoid"),
    "train.lr_schedule": ("constant", "linear", "cosine", "wsd"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.recompute": ("none", "selective", "full"),
    "logging.progress": ("auto", "bar", "lines", "none"),
    "train.fp8": ("none", "current", "delayed", "rowwise", "blockwise"),
    "train.fp8_format": ("e4m3", "hybrid"),
    "train.fp8_amax_compute_algo": ("max", "most_recent"),
    "parallel.cp_comm_type": ("p2p", "all_gather"),
    "train.attention_kernel": ("sdpa", "fa4"),
    "parallel.pipeline_split": ("even", "flops"),
}


@dataclass
class ModelConfig:
    family: str = "gpt"
    backend: str = "local"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # derived: = num_attention_heads (plain multi-head)
    head_dim: int | None = None  # derived: hidden_size // num_attention_heads
    ffn_hidden_size: int | None = None  # derived: 4h, or Megatron's 2/3 of it for swiglu
    vocab_size: int | None = None  # derived: the tokenizer's vocabulary
    padded_vocab_size: int | None = None  # derived: vocab_size padded for TP and kernels
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = True
    qk_norm: bool = False
    rope_theta: float = 10000.0
    seq_length: int = 64
    max_position_embeddings: int | None = None  # derived: seq_length
    normalization: str = "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "swiglu"
    position_embedding: str = "rope"
    bias: bool = False
    qkv_bias: bool = False  # biases on the query/key/value projection only (Qwen2); `bias` sets all
    # Llama 3's RoPE frequency scaling ("llama3"): long wavelengths divided by the factor,
    # short ones kept, the band between interpolated.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_std: float = 0.02
    # mixture of experts: the MLP of each layer in moe_layers routes every token to moe_top_k of num_experts MLPs; 0: all dense
    num_experts: int = 0
    moe_top_k: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: int | None = None  # derived: = ffn_hidden_size; each expert's MLP width
    moe_shared_expert_ffn_hidden_size: int = 0  # width of a dense MLP every token also goes through (0: none)
    moe_shared_expert_gate: bool = False  # scale the shared expert by sigmoid(a learned [h] -> 1 gate) (Qwen2-MoE)
    # softmax: probabilities over all experts (Mixtral, Qwen); sigmoid: independent scores (DeepSeek-V3)
    moe_router: str = "softmax"
    moe_norm_topk_prob: bool = True  # rescale the top-k routing weights to sum to one (Mixtral, DeepSeek-V3)
    # load-balancing loss coefficient: coeff * E * sum_i f_i * P_i (f_i: share of routed tokens, P_i: mean probability)
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient: coeff * mean(logsumexp(logits)^2) (ST-MoE)
    # expert capacity as a multiple of an even share (tokens * top_k / num_experts); the slots
    # past it with the lowest routing weights are dropped; unset or 0: dropless
    moe_capacity_factor: float | None = None
    moe_layer_freq: int = 1  # every Nth layer is MoE, from layer 0 (Megatron's int --moe-layer-freq)
    # derived: the global layer numbers whose MLP is MoE, from moe_layer_freq; set it to list them yourself
    moe_layers: list | None = None


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    # How cp ranks share keys and values (Megatron's --cp-comm-type): "p2p" passes them around a
    # ring with point-to-point sends overlapped with compute (it runs eagerly between a compiled
    # layer's graphs); "all_gather" gathers every rank's k/v at once (dK/dV reduce-scattered),
    # which compiles with the layer but holds the whole sequence's k/v on each rank.
    # derived: "all_gather" at cp = 2 under train.compile (both keep the whole sequence's k/v
    # there, and the ring's eager Python bounds the step: benchmarks/RESULTS.md), else "p2p"
    cp_comm_type: str | None = None
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    # Needs train.compile: inductor keeps the order in which a layer's code starts and waits on
    # its collectives instead of moving each start next to its wait (to lower peak memory), so
    # sequence parallelism's backward reduce-scatter runs beside the weight-gradient GEMM and
    # the all-gathered cp k/v travel while the own block's attention runs. The same kernels
    # compute the same numbers. Off by default: on 2 H200s it slowed the reference model's
    # tp=2 + sp step (0.903 against 0.757 s, benchmarks/RESULTS.md), whose rank is bound by its host,
    # and changed nothing at micro-batch 8 (0.615 against 0.614 s, fifteenth session).
    overlap_layer_comm: bool = False
    # torch's asynchronous tensor parallelism (torchtitan's enable_async_tensor_parallel): inductor
    # replaces a sequence-parallel all-gather + matmul or matmul + reduce-scatter of a compiled
    # layer with one op that splits the matmul into per-rank pieces and computes each while the
    # next piece's data travels between the GPUs over NVLink (symmetric memory, no multicast
    # needed). Needs tp > 1 with sequence_parallel, train.compile, CUDA, model.backend = 'local'.
    # Off by default: it pays only where each fused op has enough work. On 2 H200s (reference
    # model, tp=2 + sp, benchmarks/RESULTS.md, sixteenth session) micro-batch 16: 0.555-0.563
    # against 0.591-0.592 s (88-89% of one GPU per GPU); micro-batch 8: no change; micro-batch 4,
    # a rank bound by its host: 35% (53-68% without async TP in earlier sessions).
    async_tp: bool = False
    # Distributed optimizer only: all-gather updated parameters asynchronously after the step
    # and wait per bucket just before the next forward uses them (Megatron's --overlap-param-gather).
    overlap_param_gather: bool = False
    bucket_size_mb: float = 40.0
    # Layers on the first / last pipeline stage; the rest are split evenly (vpp = 1 only).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # Layers of every virtual pipeline stage, in model order: pp * vpp counts, each at least 1
    # (at pp = 2, vpp = 2: rank 0's first chunk, rank 1's first, rank 0's second, rank 1's second).
    # Balances the stages: the last also runs the LM head and loss, so [7, 6, 6, 5] for 24 layers
    # gives rank 0 13 layers and rank 1 11 plus the head. Megatron's --pipeline-model-parallel-layout
    # with only the layer counts. Unset: as pipeline_split decides (derived there under "flops").
    virtual_stage_layers: list | None = None
    # How pp > 1 sizes the stages. "even": the same number of layers each, unless
    # first/last_stage_layers or virtual_stage_layers give the counts. "flops": virtual_stage_layers
    # is derived from the model family's FLOPs per layer and for the LM head (mtl.core.stage_balance),
    # so that no rank carries the head on top of an equal share; --dry-run shows the split. On
    # 2 H200s (reference model, benchmarks/RESULTS.md, seventeenth session) pp=2: 90% of one GPU per
    # GPU against 85% even; with vpp=2 92-93% against 88-91%.
    # Unset (derived): "flops" where the family counts FLOPs per layer and no counts are given, else "even".
    pipeline_split: str | None = None
    world_size: int | None = None  # derived: from torch.distributed at resolve time
    dp: int | None = None  # derived: world_size // (tp * pp * cp)


@dataclass
class DataConfig:
    paths: list = field(default_factory=list)
    split: str = "98,1,1"
    tokenizer: str = "byte"
    tokenizer_model: str | None = None
    dataset: str = "gpt"  # gpt | mock (a registry name)
    cache_dir: str | None = None  # index cache; default: beside the first data prefix
    num_workers: int = 0
    mock_num_samples: int = 4096


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    iters: int = 40
    exit_interval: int = 0
    lr: float = 3e-3
    min_lr: float = 0.0
    warmup_iters: int = 0
    lr_schedule: str = "cosine"
    lr_decay_iters: int | None = None  # derived: iters
    wsd_decay_fraction: float = 0.2  # WSD: the last fraction of decay iters anneals to min_lr
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"
    # derived: = precision: bf16/fp16 weights, with fp32 main weights and gradients in the
    # optimizer (Megatron's layout); "fp32" keeps fp32 weights and casts them under autocast
    params_dtype: str | None = None
    # FP8 GEMMs in the transformer layers (the backend's; see mtl.core.registrations.Fp8Settings):
    # none | current | delayed | rowwise | blockwise, as the selected backend implements them.
    fp8: str = "none"
    fp8_format: str = "hybrid"  # e4m3 everywhere, or hybrid: e4m3 forward, e5m2 gradients
    fp8_amax_history_len: int = 16  # delayed scaling: how many earlier amaxes set the scale
    fp8_amax_compute_algo: str = "max"  # delayed scaling: max over the history, or most_recent
    fp8_margin: int = 0  # delayed scaling: scale = fp8_max / amax / 2**margin
    # the forward GEMM in Hopper's fast FP8 accumulation, as TE's and torchao's recipes do (the
    # backward GEMMs always accumulate exactly). The fp8 backend's; te keeps TE's recipe (refuses false)
    fp8_fast_accumulation: bool = True
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    initial_loss_scale: float = 65536.0
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    recompute: str = "none"
    # regional torch.compile of each transformer layer; derived: on where the run uses CUDA
    # (1.41x faster on the H100 reference model, benchmarks/RESULTS.md), off on CPU, and off
    # for FP8 on a backend whose FP8 modules do not compile (Backend.fp8_compiles, e.g. te)
    # unless train.cuda_graphs is on
    compile: bool | None = None
    # inductor's C++ wrapper for the compiled layers (torch.compile's cpp_wrapper option): each
    # layer's kernels are launched from compiled C++, not from generated Python. Pays where a rank
    # is bound by its host: a tp=2+sp rank of the H100 reference model 0.548 against 0.571-0.694 s
    # per step; on 2 H200s tp=2+sp 0.691 s against 0.751-0.957 s in other calls (not A/B'd in one);
    # no change on one GPU (benchmarks/RESULTS.md). The first compile takes about a
    # minute longer (cached on disk after). Needs train.compile; with collectives inside the
    # layers (tp, cp or ep > 1) it needs torch < 2.13, whose C++ wrapper cannot pass them a group
    compile_cpp_wrapper: bool = False
    # CUDA graphs of each transformer layer's training forward and backward (Megatron's
    # --enable-cuda-graph), captured on the first step: the host launches one graph per layer
    # instead of every kernel (pays where the host is the bottleneck, as with te; not for local
    # or fp8: benchmarks/RESULTS.md). CUDA, one GPU (no tp/pp/cp/dp), dense layers, no recompute or
    # dropout, not FP8 delayed scaling
    cuda_graphs: bool = False
    # the core attention's kernel: sdpa (PyTorch's F.scaled_dot_product_attention picks: cuDNN's
    # fused attention on Hopper) | fa4 (FlashAttention-4, the flash-attn-4 package, as SDPA's kernel:
    # 12% less attention time than cuDNN on the H100 reference model, benchmarks/RESULTS.md).
    # fa4: CUDA Hopper or Blackwell, no attention dropout, parallel.cp = 1, the local or fp8 backend
    attention_kernel: str = "sdpa"
    device: str = "auto"  # auto | cpu | cuda
    # a NaN/Inf loss or gradient norm stops the run; N > 0 skips (no update) up to N such steps
    skip_bad_steps: int = 0
    # Python's automatic garbage collection off during training, and a full collection every N
    # steps on every rank at the same step, over what the steps created (mtl.train.garbage_collection):
    # no collection pauses one rank's host at a random point of a step. 0: Python's automatic
    # collection. Like torchtitan's gc_freq (on, 50; it collects the young generations only); unlike
    # Megatron's --manual-gc, off by default there, whose --manual-gc-interval 0 means never
    gc_interval: int = 50
    num_micro_batches: int | None = None  # derived: global / (micro * dp)


@dataclass
class CkptConfig:
    save: str | None = None
    load: str | None = None
    interval: int = 0
    async_save: bool = False
    format: str = "zarr"
    save_on_exit: bool = True
    # false: take only the weights from the checkpoint; iteration, optimizer and schedule start fresh
    load_optimizer: bool = True
    # weights to start from (any layout, or `mtl convert` output) when ckpt.load has no checkpoint yet
    finetune_from: str | None = None
    keep_last: int = 0  # keep the newest N committed checkpoints in ckpt.save (0: keep all)
    # true: when ckpt.save holds this run's checkpoints, resume from its latest (Megatron's
    # --load = --save); false (mtl train --fresh): start over, only into an empty ckpt.save
    resume: bool = True
    interval_minutes: float = 0.0  # also save when this many minutes passed since the last save (0: off)
    # resume from this committed iteration of the starting checkpoint directory instead of its latest
    load_iteration: int | None = None


@dataclass
class LoggingConfig:
    dir: str = "runs/default"
    interval: int = 1
    tensorboard: bool = False
    callbacks: list = field(default_factory=lambda: ["jsonl"])
    # Dense bf16 matmul peak of one GPU in TFLOP/s, for MFU (0: MFU not reported).
    # 778 is what torch measures on the H100 machines (see benchmarks/RESULTS.md).
    peak_tflops: float = 0.0
    # auto: a live progress display on an interactive terminal, plain lines otherwise;
    # bar | lines | none force one
    progress: str = "auto"
    wandb: bool = False  # also log to Weights & Biases (pip install 'mtl-train[wandb]'); resumed runs continue the same W&B run
    wandb_project: str = "mtl"  # the W&B project
    wandb_mode: str | None = None  # online | offline | disabled; unset: WANDB_MODE, else wandb's default


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "ckpt": CkptConfig,
    "logging": LoggingConfig,
}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resolved: bool = False

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def resolve(self, world_size: int = 1, tokenizer_vocab_size: int | None = None) -> "RunConfig":
        """A copy with every derived value filled in and every constraint checked."""
        from mtl.core.config_io import config_from_dict  # noqa: PLC0415 (cyclic by design)

        cfg = config_from_dict(self.to_dict())
        m, p, t = cfg.model, cfg.parallel, cfg.train
        for dotted, allowed in CHOICES.items():
            section, key = dotted.split(".")
            value = getattr(getattr(cfg, section), key)
            if value is None and getattr(type(getattr(cfg, section))(), key) is None:
                continue  # a derived key left unset: filled below
            if value not in allowed:
                raise ConfigError(f"{dotted} = {value!r} is not one of {', '.join(allowed)}")
        for section in (m, p, t):
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                    raise ConfigError(f"{_key(section, f.name)} = {value} must not be negative")

        _resolve_parallel(p, world_size, m)
        _resolve_model(m, p, tokenizer_vocab_size)
        compile_unset = t.compile is None
        _resolve_train(t, p)
        _check_backend(cfg, compile_unset)
        _resolve_cp_comm_type(p, t)
        _check_overlap_layer_comm(p, t)
        _check_compile_cpp_wrapper(p, t)
        _check_async_tp(m, p, t)
        _check_cuda_graphs(m, p, t)
        _check_attention_kernel(m, p, t)
        cfg.resolved = True
        _resolve_flops_split(cfg)
        return cfg


def _key(section: Any, name: str) -> str:
    for sname, cls in SECTIONS.items():
        if isinstance(section, cls):
            return f"{sname}.{name}"
    return name


def _resolve_parallel(p: ParallelConfig, world_size: int, m: ModelConfig) -> None:
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} = {getattr(p, name)} must be at least 1")
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = "
            f"{model_parallel}; launch a multiple of {model_parallel} processes"
        )
    p.world_size = world_size
    p.dp = world_size // model_parallel
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp = {p.vpp} needs parallel.pp > 1")
    if p.ep > 1 and p.dp % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} must divide the data-parallel size {p.dp}")
    if p.overlap_param_gather and not p.distributed_optimizer:
        raise ConfigError(
            "parallel.overlap_param_gather = true needs parallel.distributed_optimizer = true "
            "(only the distributed optimizer all-gathers parameters after its step)"
        )
    if p.sequence_parallel and p.tp == 1:
        p.sequence_parallel = False  # nothing to shard: sequence parallelism rides on TP
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
    if p.pipeline_split is None:
        p.pipeline_split = _default_pipeline_split(p, m)
    if p.pipeline_split == "flops" and p.virtual_stage_layers is None:
        _check_flops_split(m.num_layers, p)  # the split itself needs the resolved model: resolve's end
    else:
        pipeline_layer_split(m.num_layers, p)  # raises on a bad split


def pipeline_layer_split(num_layers: int, p: ParallelConfig) -> list[int]:
    """Layers per virtual stage, in model order: ``pp * vpp`` entries summing to num_layers.

    ``virtual_stage_layers`` gives every size; otherwise the first and last stages may be given
    explicit sizes and the rest are split evenly."""
    if p.virtual_stage_layers is not None:
        return _explicit_layer_split(num_layers, p)
    stages = p.pp * p.vpp
    first, last = p.first_stage_layers, p.last_stage_layers
    if first is None and last is None:
        if num_layers % stages:
            raise ConfigError(
                f"model.num_layers = {num_layers} is not divisible by pp*vpp = {p.pp}*{p.vpp} = "
                f"{stages}; change num_layers, set parallel.pipeline_split = 'flops', or give the counts in "
                "parallel.virtual_stage_layers (or, at vpp = 1, parallel.first_stage_layers/last_stage_layers)"
            )
        return [num_layers // stages] * stages
    if p.vpp > 1:
        raise ConfigError("parallel.first_stage_layers/last_stage_layers need parallel.vpp = 1; at vpp > 1 "
                          "parallel.virtual_stage_layers gives every virtual stage's layers")
    if stages == 1:
        raise ConfigError("parallel.first_stage_layers/last_stage_layers need parallel.pp > 1")
    fixed = (first or 0) + (last or 0)
    free_stages = stages - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if rest < 0 or (free_stages and rest % free_stages) or (not free_stages and rest):
        raise ConfigError(
            f"model.num_layers = {num_layers} minus first/last stage layers ({fixed}) does not "
            f"split evenly over the remaining {free_stages} pipeline stages"
        )
    even = rest // free_stages if free_stages else 0
    split = [even] * stages
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split


def pipeline_rank_layers(num_layers: int, p: ParallelConfig) -> list[list[int]]:
    """The global layer indices each pipeline rank holds, from ``pipeline_layer_split`` (virtual
    stage ``v`` runs on rank ``v % pp``)."""
    ranks: list[list[int]] = [[] for _ in range(p.pp)]
    start = 0
    for stage, count in enumerate(pipeline_layer_split(num_layers, p)):
        ranks[stage % p.pp].extend(range(start, start + count))
        start += count
    return ranks


def _explicit_layer_split(num_layers: int, p: ParallelConfig) -> list[int]:
    """``parallel.virtual_stage_layers``, checked against the layout and the model."""
    counts, stages = p.virtual_stage_layers, p.pp * p.vpp
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        raise ConfigError("parallel.virtual_stage_layers gives every stage's layers: unset "
                          "parallel.first_stage_layers/last_stage_layers, or put their counts in it")
    if p.pp == 1:
        raise ConfigError("parallel.virtual_stage_layers needs parallel.pp > 1 (one stage holds every layer)")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
        raise ConfigError(f"parallel.virtual_stage_layers = {counts!r}: every entry must be a whole number "
                          "of layers, at least 1")
    if len(counts) != stages:
        raise ConfigError(f"parallel.virtual_stage_layers = {counts!r} has {len(counts)} entries; it needs "
                          f"pp*vpp = {p.pp}*{p.vpp} = {stages}, one per virtual stage in model order")
    if sum(counts) != num_layers:
        raise ConfigError(f"parallel.virtual_stage_layers = {counts!r} sums to {sum(counts)} layers; "
                          f"model.num_layers = {num_layers}")
    return list(counts)


def _default_pipeline_split(p: ParallelConfig, m: ModelConfig) -> str:
    """``parallel.pipeline_split`` unset: by FLOPs at pp > 1 where the model family counts them and
    no layer counts are given (the split users run fastest, by measurement); else even."""
    given = p.virtual_stage_layers is not None or p.first_stage_layers is not None or p.last_stage_layers is not None
    if p.pp == 1 or given:
        return "even"
    return "flops" if _family_counting_layer_flops(m.family) is not None else "even"


def _family_counting_layer_flops(name: str):
    """The registered model family ``name`` if it gives its FLOPs in all and per layer, else None."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    families = registry("model family")
    family = families.get(name) if name in families else None
    if family is None or family.flops_per_iteration is None or family.layer_flops_per_iteration is None:
        return None
    return family


def _check_flops_split(num_layers: int, p: ParallelConfig) -> None:
    """What ``parallel.pipeline_split = "flops"`` can be checked for before the model is resolved."""
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        raise ConfigError("parallel.pipeline_split = 'flops' sizes every stage: unset "
                          "parallel.first_stage_layers/last_stage_layers, or use pipeline_split = 'even'")
    if num_layers < p.pp * p.vpp:
        raise ConfigError(f"model.num_layers = {num_layers} cannot fill pp*vpp = {p.pp}*{p.vpp} = "
                          f"{p.pp * p.vpp} pipeline stages with at least one layer each")


def layer_and_head_flops(cfg: "RunConfig") -> tuple[list[float], float] | None:
    """The resolved config's FLOPs per iteration of each layer and of the rest (the LM head and
    loss, on the last stage), as the model family counts them; None where it does not."""
    m = cfg.model
    family = _family_counting_layer_flops(m.family)
    if family is None:
        return None
    layer_costs = family.layer_flops_per_iteration(cfg)
    if len(layer_costs) != m.num_layers:
        raise ConfigError(f"model family '{m.family}': layer_flops_per_iteration gave {len(layer_costs)} counts for "
                          f"model.num_layers = {m.num_layers}; it must give one per layer (until it does, "
                          "parallel.pipeline_split = 'even' splits the stages without them)")
    return layer_costs, family.flops_per_iteration(cfg) - sum(layer_costs)


def _resolve_flops_split(cfg: "RunConfig") -> None:
    """``parallel.pipeline_split = "flops"``: derive ``virtual_stage_layers`` from the model family's
    FLOP counts (``mtl.core.stage_balance``). A split already given must be the one derived (a
    resolved config resolves again to itself)."""
    from mtl.core.stage_balance import balance_stage_layers  # noqa: PLC0415 (only this option needs it)

    m, p = cfg.model, cfg.parallel
    if p.pipeline_split != "flops" or p.pp == 1:
        return  # at pp = 1 one stage holds every layer: nothing to balance
    counts = layer_and_head_flops(cfg)
    if counts is None:
        raise ConfigError(f"parallel.pipeline_split = 'flops' needs the FLOPs of each layer of model family "
                          f"'{m.family}' (its flops_per_iteration and layer_flops_per_iteration), which it does not "
                          "give here; set parallel.virtual_stage_layers by hand, or pipeline_split = 'even'")
    derived = balance_stage_layers(*counts, p.pp, p.vpp)
    if p.virtual_stage_layers is not None and list(p.virtual_stage_layers) != derived:
        raise ConfigError(f"parallel.virtual_stage_layers = {p.virtual_stage_layers!r} is not the split "
                          f"parallel.pipeline_split = 'flops' derives ({derived}): unset one of them")
    p.virtual_stage_layers = derived


def _resolve_model(m: ModelConfig, p: ParallelConfig, tokenizer_vocab_size: int | None) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must be at least 1")
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
            f"model.num_query_groups = {m.num_query_groups}"
        )
    if m.head_dim is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size = {m.hidden_size} is not divisible by "
                f"model.num_attention_heads = {m.num_attention_heads}; set model.head_dim"
            )
        m.head_dim = m.hidden_size // m.num_attention_heads
    if m.num_attention_heads % p.tp or m.num_query_groups % p.tp:
        raise ConfigError(
            f"parallel.tp = {p.tp} must divide model.num_attention_heads = "
            f"{m.num_attention_heads} and model.num_query_groups = {m.num_query_groups}"
        )
    if m.ffn_hidden_size is None:
        # A gated MLP has three matrices instead of two; Megatron keeps the parameter count
        # of a 4h MLP by taking 2/3 of it, rounded down to a multiple of 64.
        if m.activation == "swiglu":
            m.ffn_hidden_size = int(4 * m.hidden_size * 2 / 3 / 64) * 64 or 64
        else:
            m.ffn_hidden_size = 4 * m.hidden_size
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(
            f"model.ffn_hidden_size = {m.ffn_hidden_size} is not divisible by parallel.tp = {p.tp}"
        )
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.seq_length > m.max_position_embeddings and m.position_embedding == "learned":
        raise ConfigError(
            f"model.seq_length = {m.seq_length} exceeds model.max_position_embeddings = "
            f"{m.max_position_embeddings} (learned positions cannot extrapolate)"
        )
    if m.vocab_size is None:
        if tokenizer_vocab_size is None:
            raise ConfigError("model.vocab_size is not set and no tokenizer gave one")
        m.vocab_size = tokenizer_vocab_size
    elif tokenizer_vocab_size is not None and m.vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab_size}); remove the key or raise it"
        )
    _resolve_moe(m, p)
    # Pad so every TP rank holds an equal, kernel-friendly slice of the vocabulary.
    multiple = m.make_vocab_size_divisible_by * p.tp
    m.padded_vocab_size = int(math.ceil(m.vocab_size / multiple) * multiple)


def _resolve_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """The MoE keys: which layers are MoE, the expert width, and what the layout must divide."""
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
        for key in ("moe_shared_expert_gate", "moe_capacity_factor"):  # set, they would do nothing
            if getattr(m, key):
                raise ConfigError(f"model.{key} = {getattr(m, key)} needs model.num_experts > 0 (it is 0)")
        m.moe_layers = []
        return
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
    if m.moe_layer_freq < 1:
        raise ConfigError(f"model.moe_layer_freq = {m.moe_layer_freq} must be at least 1")
    if m.moe_layers is None:
        # Megatron's int --moe-layer-freq: layer i is MoE when i % N == 0
        m.moe_layers = [i for i in range(m.num_layers) if i % m.moe_layer_freq == 0]
    elif sorted(set(m.moe_layers)) != list(m.moe_layers) or any(
        not isinstance(i, int) or not 0 <= i < m.num_layers for i in m.moe_layers
    ):
        raise ConfigError(
            f"model.moe_layers = {m.moe_layers} must list distinct layer numbers in [0, "
            f"{m.num_layers}) in increasing order"
        )
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size  # an expert is a copy of the dense MLP unless told
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
    if m.moe_capacity_factor is not None:
        if m.moe_capacity_factor < 0:
            raise ConfigError(f"model.moe_capacity_factor = {m.moe_capacity_factor} must not be negative")
        if m.moe_capacity_factor == 0:
            m.moe_capacity_factor = None  # 0 means dropless: one spelling of it downstream


def _check_overlap_layer_comm(p: ParallelConfig, t: TrainConfig) -> None:
    """After train.compile and cp_comm_type are final: the overlap is a scheduling choice of
    inductor's, over the collectives written to overlap (sequence parallelism's column linear,
    all-gathered cp k/v); anywhere else the key would change nothing."""
    if not p.overlap_layer_comm:
        return
    if not t.compile:
        raise ConfigError(
            "parallel.overlap_layer_comm = true needs train.compile = true (inductor schedules the layer's "
            "collectives); set train.compile = true, or parallel.overlap_layer_comm = false"
        )
    if not ((p.tp > 1 and p.sequence_parallel) or (p.cp > 1 and p.cp_comm_type == "all_gather")):
        raise ConfigError(
            f"parallel.overlap_layer_comm = true orders the collectives of tp > 1 with sequence_parallel or of "
            f"cp > 1 with cp_comm_type = 'all_gather'; this layout (tp = {p.tp}, sequence_parallel = "
            f"{str(p.sequence_parallel).lower()}, cp = {p.cp}, cp_comm_type = '{p.cp_comm_type}') has none: "
            "set parallel.overlap_layer_comm = false"
        )


def _check_compile_cpp_wrapper(p: ParallelConfig, t: TrainConfig) -> None:
    """After train.compile is final. Under torch 2.13 inductor's C++ wrapper refuses the functional
    collectives a compiled tensor-, context- or expert-parallel layer contains (their group
    argument is typed ``Any``, which its call into Python ops cannot pass): refused here, before
    the first step's compile fails."""
    if not t.compile_cpp_wrapper:
        return
    if not t.compile:
        raise ConfigError("train.compile_cpp_wrapper = true needs train.compile = true (it is how inductor "
                          "launches the compiled layers' kernels); set train.compile = true, or "
                          "train.compile_cpp_wrapper = false")
    split = [f"parallel.{name} = {getattr(p, name)}" for name in ("tp", "cp", "ep") if getattr(p, name) > 1]
    release = torch_release()
    if split and release >= (2, 13):
        raise ConfigError(f"train.compile_cpp_wrapper = true with {', '.join(split)} needs torch < 2.13: "
                          f"torch {release[0]}.{release[1]}'s C++ wrapper cannot call the compiled layers' "
                          "collectives; set train.compile_cpp_wrapper = false")


def _check_async_tp(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """After train.compile is final. Async TP is an inductor pass over a compiled layer's
    sequence-parallel collectives and the CUDA ops that replace them: anywhere else the key would
    do nothing or fail at the first step, so it is refused here, naming what to change."""
    if not p.async_tp:
        return
    conflicts = [  # the device first: on a CPU the rest would not make it work
        (_uses_cpu(t), "a CPU run", "a CUDA device (the fused ops are CUDA ops over NCCL symmetric memory)"),
        (p.tp < 2 or not p.sequence_parallel,
         f"parallel.tp = {p.tp}, sequence_parallel = {str(p.sequence_parallel).lower()}",
         "parallel.tp > 1 with parallel.sequence_parallel = true (it fuses the sequence-parallel all-gathers and "
         "reduce-scatters with their matmuls)"),
        (not t.compile, "train.compile = false", "train.compile = true (an inductor pass does the fusing)"),
        (m.backend != "local", f"model.backend = '{m.backend}'",
         "'local' (its linears are the matmuls inductor sees; other backends' are not run with it yet)"),
        (t.compile_cpp_wrapper, "train.compile_cpp_wrapper = true", "false (not run together yet)"),
    ]
    for conflict, setting, fix in conflicts:
        if conflict:
            raise ConfigError(f"parallel.async_tp = true does not work with {setting}: use {fix}, "
                              "or set parallel.async_tp = false")


def _resolve_cp_comm_type(p: ParallelConfig, t: TrainConfig) -> None:
    """After train.compile is final (a backend may turn it off). At cp = 2 the ring keeps its own
    block and the one it received for the backward, the whole sequence's k/v, as the all-gather
    does; above that the ring holds less, so it stays the default there."""
    if p.cp_comm_type is None:
        p.cp_comm_type = "all_gather" if t.compile and p.cp == 2 else "p2p"


def _resolve_train(t: TrainConfig, p: ParallelConfig) -> None:
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("train.micro_batch_size and train.global_batch_size must be at least 1")
    if t.params_dtype is None:
        t.params_dtype = t.precision
    if t.compile is None:
        import torch  # noqa: PLC0415 (only to see whether this run will use CUDA)

        t.compile = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if t.params_dtype not in ("fp32", t.precision):
        raise ConfigError(
            f"train.params_dtype = {t.params_dtype!r} with train.precision = {t.precision!r}: the weights "
            f"are either '{t.precision}' (fp32 main weights in the optimizer) or 'fp32' (autocast)"
        )
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"micro_batch_size * dp = {t.micro_batch_size} * {p.dp} = {per_step}"
        )
    t.num_micro_batches = t.global_batch_size // per_step
    if p.vpp > 1 and t.num_micro_batches % p.pp:
        raise ConfigError(
            f"the interleaved pipeline schedule needs micro-batches per step "
            f"({t.num_micro_batches}) divisible by parallel.pp = {p.pp}"
        )
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.iters
    if t.warmup_iters > t.lr_decay_iters:
        raise ConfigError(
            f"train.warmup_iters = {t.warmup_iters} exceeds train.lr_decay_iters = {t.lr_decay_iters}"
        )
    if not 0.0 <= t.wsd_decay_fraction <= 1.0:
        raise ConfigError(f"train.wsd_decay_fraction = {t.wsd_decay_fraction} must be in [0, 1]")


def _check_cuda_graphs(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """``train.cuda_graphs`` replays each layer's captured kernels with no Python in between,
    so whatever needs the host between them, or a second copy of a layer's activations, is
    refused here, before any work, with the key to change."""
    if not t.cuda_graphs:
        return
    conflicts = [
        # data parallelism looks sound on paper (the hooks run after each layer's backward
        # replay) but has not run with captured layers: refused until a multi-GPU test has
        (p.dp is not None and p.dp > 1, f"data parallelism (parallel.dp = {p.dp}, from the world size)",
         "1 process (captured layers are verified on one GPU only so far)"),
        (p.tp > 1, f"parallel.tp = {p.tp}", "1"),
        (p.pp > 1, f"parallel.pp = {p.pp}", "1 (a pipeline keeps several micro-batches of a layer in flight)"),
        (p.cp > 1, f"parallel.cp = {p.cp}", "1"),
        (p.overlap_param_gather, "parallel.overlap_param_gather = true", "false (its waits run before each layer)"),
        (m.num_experts > 0, f"model.num_experts = {m.num_experts}", "0 (routing sizes the experts' work on the host)"),
        (t.recompute != "none", f"train.recompute = '{t.recompute}'", "'none'"),
        (m.hidden_dropout > 0, f"model.hidden_dropout = {m.hidden_dropout}", "0"),
        (m.attention_dropout > 0, f"model.attention_dropout = {m.attention_dropout}", "0"),
        (t.fp8 == "delayed", "train.fp8 = 'delayed'", "'current' (the amax history is kept on the host's schedule)"),
        (t.params_dtype != t.precision, f"train.params_dtype = '{t.params_dtype}' with precision '{t.precision}'",
         f"'{t.precision}' (autocast's weight cache cannot be captured)"),
    ]
    for conflict, setting, fix in conflicts:
        if conflict:
            raise ConfigError(f"train.cuda_graphs = true does not work with {setting}: set it to {fix}, "
                              "or train.cuda_graphs = false")
    if _uses_cpu(t):
        raise ConfigError("train.cuda_graphs = true needs a CUDA device (this run uses the CPU); "
                          "set train.cuda_graphs = false")


def _uses_cpu(t: TrainConfig) -> bool:
    import torch  # noqa: PLC0415 (only to see whether this run will use CUDA)

    return t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())


def _check_attention_kernel(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """``train.attention_kernel = "fa4"`` swaps SDPA's kernel in mtl's own core attention
    (mtl.parallel.backend_local.fa4); what it cannot serve is refused here, before any work."""
    if t.attention_kernel != "fa4":
        return
    conflicts = [
        (m.backend == "te", "model.backend = 'te' (Transformer Engine runs its own attention)", "model.backend = 'local'"),
        (m.attention_dropout > 0, f"model.attention_dropout = {m.attention_dropout} (FA4 has no dropout)",
         "model.attention_dropout = 0"),
        # the ring's blocks would reach FA4 through aten's flash ops too, but no run has checked them
        (p.cp > 1, f"parallel.cp = {p.cp} (context parallelism is verified on cuDNN and FA2 only)", "parallel.cp = 1"),
        (_uses_cpu(t), "a CPU run", "a CUDA device (train.device = 'cuda')"),
    ]
    for conflict, setting, fix in conflicts:
        if conflict:
            raise ConfigError(f"train.attention_kernel = 'fa4' does not work with {setting}: use {fix}, "
                              "or train.attention_kernel = 'sdpa'")


def _check_backend(cfg: "RunConfig", compile_unset: bool = False) -> None:
    """The selected backend accepts the settings (its ``check_config``), can run here and
    implements the FP8 recipe asked for. Only a backend that is registered is asked (a missing
    one is named when the model is built). ``compile_unset``: ``train.compile`` was derived,
    not given, so the backend's ``fp8_compiles = False`` may turn it off for an FP8 run."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    m, t = cfg.model, cfg.train

    if t.fp8 != "none" and t.fp8_amax_history_len < 1:
        raise ConfigError(f"train.fp8_amax_history_len = {t.fp8_amax_history_len} must be at least 1")
    backends = registry("backend")
    if m.backend not in backends:
        return
    backend = backends.get(m.backend)
    if backend.check_config is not None:  # first: a setting it refuses is named even where it is not installed
        backend.check_config(cfg)
    if backend.check_available is not None:
        backend.check_available()
    if t.fp8 != "none" and t.fp8 not in backend.fp8_recipes:
        others = [f"'{name}' ({', '.join(backends.get(name).fp8_recipes)})" for name in backends.names()
                  if t.fp8 in backends.get(name).fp8_recipes]
        offer = f"; backends that do: {', '.join(others)}" if others else ""
        raise ConfigError(
            f"train.fp8 = '{t.fp8}' is not a recipe of model.backend = '{m.backend}' (it has: "
            f"{', '.join(backend.fp8_recipes) or 'no FP8'}){offer}; set train.fp8 = 'none' or change model.backend"
        )
    if compile_unset and t.fp8 != "none" and not backend.fp8_compiles and not t.cuda_graphs:
        # its FP8 modules stay eager: graph breaks around each cost more than compile gains,
        # unless the layers are captured (train.cuda_graphs), where the host's cost is gone
        t.compile = False
