"""The run configuration's sections: one dataclass each, with every key's default and meaning.

Fields whose default is ``None`` and whose comment says *derived* are filled by
``RunConfig.resolve`` (``mtl.core.config_derive``); modules receive the resolved config and never
re-derive anything. The comment beside a field is its documentation: ``mtl.cli.config_reference``
turns these comments into docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHOICES: dict[str, tuple[str, ...]] = {
    "model.normalization": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "swiglu", "relu2", "relu", "gated-gelu"),
    "model.position_embedding": ("learned", "rope", "none"),
    "model.rope_scaling": ("none", "llama3"),
    "model.moe_router": ("softmax", "sigmoid"),
    "model.norm_position": ("pre", "post"),
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
    "parallel.sharding": ("none", "optimizer", "gradients", "parameters"),
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
    # the MLP's: "swiglu" (gated, Llama), "gelu" (GPT-2, BERT), "relu2" (squared ReLU, Nemotron-H's dense
    # MLP); t5: "relu" (T5 1.0) | "gated-gelu" (T5 1.1, Flan-T5; tanh GELU)
    activation: str = "swiglu"
    # "rope" (rotary), "learned" (a table of max_position_embeddings), "none" (no positions: Nemotron-H's
    # attention, where the Mamba layers carry the order)
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
    # add a per-expert bias (router.expert_bias) to the scores when choosing the top k, never to the
    # weights (DeepSeek-V3, Nemotron-H's e_score_correction_bias; Megatron's --moe-router-enable-expert-bias);
    # it starts at zero (or a converted checkpoint's values) and moves by moe_router_bias_update_rate
    moe_router_expert_bias: bool = False
    # aux-loss-free balancing: after each step every expert bias moves by this much toward balance,
    # rate * sign(mean count - the expert's count), the counts over the step's tokens on all data- and
    # context-parallel ranks (Megatron's --moe-router-bias-update-rate, its default); 0: the bias stays as loaded
    moe_router_bias_update_rate: float = 1e-3
    # multiplies the top-k routing weights after any normalisation (Megatron's
    # --moe-router-topk-scaling-factor, HF's routed_scaling_factor)
    moe_router_scaling_factor: float = 1.0
    # group-limited routing (DeepSeek-V3; Megatron's --moe-router-num-groups): the experts form this many
    # equal groups, each token keeps the moe_router_group_topk groups whose best moe_top_k / group_topk
    # scores sum highest and picks its top k inside them; 1: no groups
    moe_router_num_groups: int = 1
    moe_router_group_topk: int = 1  # groups each token may route into (Megatron's --moe-router-group-topk)
    # load-balancing loss coefficient: coeff * E * sum_i f_i * P_i (f_i: share of routed tokens, P_i: mean probability)
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient: coeff * mean(logsumexp(logits)^2) (ST-MoE)
    # expert capacity as a multiple of an even share (tokens * top_k / num_experts); the slots
    # past it with the lowest routing weights are dropped; unset or 0: dropless
    moe_capacity_factor: float | None = None
    moe_layer_freq: int = 1  # every Nth layer is MoE, from layer 0 (Megatron's int --moe-layer-freq)
    # derived: the global layer numbers whose MLP is MoE, from moe_layer_freq; set it to list them yourself
    moe_layers: list | None = None
    # hybrid family (Megatron's hybrid / Nemotron-H): one symbol per layer, Megatron's: "M" a Mamba-2
    # mixer, "*" self-attention, "-" an MLP, "E" an MoE MLP (model.num_experts); each is a pre-norm
    # residual layer. "|" cuts pipeline stages (pp * vpp - 1 of them); without any, pp > 1 splits by
    # FLOPs. Its length (without "|") must be model.num_layers. Unset: not a hybrid model.
    hybrid_pattern: str | None = None
    mamba_state_dim: int = 128  # N: the size of each SSM head's state per channel (Megatron's default)
    mamba_head_dim: int = 64  # P: channels per SSM head
    mamba_num_groups: int = 8  # G: groups of heads sharing B and C; TP splits whole groups
    mamba_expand: int = 2  # the mixer's inner width is mamba_expand * hidden_size
    mamba_num_heads: int | None = None  # derived: mamba_expand * hidden_size // mamba_head_dim
    mamba_conv_kernel: int = 4  # width of the depthwise causal convolution over x, B and C
    mamba_chunk_size: int = 128  # positions per chunk of the SSD scan (speed only: same numbers)
    # the smallest step the scan takes: dt = max(softplus(dt + dt_bias), mamba_dt_min). 0: no floor
    # (Megatron, Mamba2); Nemotron-H's HF model floors it at its time_step_min (0.001)
    mamba_dt_min: float = 0.0
    # Encoder families (bert). Where each layer's norms sit: "pre" normalises each branch's
    # input and adds a final norm (Megatron's BERT, every gpt model); "post" normalises after
    # each residual add and once after the embeddings, with no final norm (original BERT, RoBERTa:
    # what Hugging Face checkpoints hold). The gpt family is pre-norm only.
    norm_position: str = "pre"
    type_vocab_size: int = 0  # bert: rows of the token-type (segment) embedding (BERT 2, RoBERTa 1; 0: none)
    # bert: learned position ids start here (RoBERTa counts positions from padding_idx + 1 = 2,
    # so its table has two rows before the first position); the table holds max_position_embeddings + offset rows
    position_offset: int = 0
    binary_head: bool = False  # bert: a pooler on the first token and a 2-way head (NSP / sentence order), trained on is_random
    # bert: > 0 replaces the pre-training heads with sequence classification over this many labels
    # (HF BertForSequenceClassification: pooler on [CLS], dropout, linear; cross-entropy, accuracy),
    # trained on data.dataset = 'classification'; 0: the masked-LM (and binary) heads
    num_labels: int = 0
    # t5: decoder layers (the encoder has num_layers); derived: = num_layers
    num_decoder_layers: int | None = None
    # t5: buckets of the relative position bias (half per direction in the encoder; T5's 32)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128  # t5: distances from this on share the last bucket (T5's 128)
    # t5: multiply the decoder output by hidden_size**-0.5 before the LM head (T5 1.0, whose head
    # is the embedding; T5 1.1 and Flan-T5 do not)
    scale_decoder_output: bool = False


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
    # there, and the ring's eager Python bounds the step: benchmarks/log), else "p2p"
    cp_comm_type: str | None = None
    ep: int = 1
    sequence_parallel: bool = False
    # Megatron's spelling of sharding = "optimizer" (--use-distributed-optimizer): true means at
    # least the optimizer state is sharded. derived: true when sharding is not "none".
    distributed_optimizer: bool | None = None
    # What data-parallel ranks shard (ZeRO stages 0-3): "none" replicates everything; "optimizer"
    # the AdamW moments and fp32 main weights (ZeRO-1); "gradients" also the reduced gradients,
    # each bucket reduce-scattered every micro-batch and freed (ZeRO-2); "parameters" also the
    # weights, all-gathered per layer just before its forward (the next layer's gather in flight)
    # and freed after it, gathered again for its backward (ZeRO-3 / FSDP; mtl.parallel.ddp).
    # derived: "optimizer" if distributed_optimizer = true, else "none".
    sharding: str | None = None
    # Hybrid sharding (HSDP, Megatron-FSDP's outer dp): the dp x cp ranks form dp_replicate groups
    # that each hold a whole sharded copy, shard within a group of dp*cp/dp_replicate ranks and
    # all-reduce the gradient shards across groups. 1: shard over every dp x cp rank.
    dp_replicate: int = 1
    overlap_grad_reduce: bool = True
    # torch's asynchronous tensor parallelism (torchtitan's enable_async_tensor_parallel): inductor
    # replaces a sequence-parallel all-gather + matmul or matmul + reduce-scatter of a compiled
    # layer with one op that splits the matmul into per-rank pieces and computes each while the
    # next piece's data travels between the GPUs over NVLink (symmetric memory, no multicast
    # needed). Needs tp > 1 with sequence_parallel, train.compile, CUDA, model.backend = 'local'.
    # Off by default: it pays only where each fused op has enough work. On 2 H200s (reference
    # model, tp=2 + sp, benchmarks/log, sixteenth session) micro-batch 16: 0.555-0.563
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
    # 2 H200s (reference model, benchmarks/log, seventeenth session) pp=2: 90% of one GPU per
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
    dataset: str = "gpt"  # gpt | bert | t5 | classification | mock (a registry name)
    cache_dir: str | None = None  # index cache; default: beside the first data prefix
    num_workers: int = 0
    mock_num_samples: int = 4096
    mask_prob: float = 0.15  # bert/t5: share of each sample's tokens masked (Megatron's --mask-prob)
    # bert/t5: share of samples given a random shorter target length (Megatron's --short-seq-prob)
    short_seq_prob: float = 0.1
    # bert/t5: longest masked n-gram (t5: span) in candidate tokens; derived: 3 for bert, 10 for t5
    # (the values Megatron's pretrain_bert.py / pretrain_t5.py hard-code)
    masking_max_ngram: int | None = None
    # bert/t5: whole-word masking, a word's "##" pieces are masked with it; derived: false for bert, true for t5
    masking_do_full_word: bool | None = None
    # bert/t5: n-gram lengths drawn from a geometric(0.2) law (SpanBERT, T5's spans) instead of
    # probabilities proportional to 1/n; derived: false for bert, true for t5
    masking_use_geometric_distribution: bool | None = None
    masking_use_longer_ngrams: bool = False  # bert/t5: n-gram probabilities proportional to n instead of 1/n
    # t5: decoder tokens per sample ([BOS] + sentinels + masked spans, padded); Megatron's --decoder-seq-length
    decoder_seq_length: int = 128


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    iters: int = 40
    exit_interval: int = 0
    lr: float = 3e-3
    min_lr: float = 0.0
    # linear warmup steps; where train.lr_decay_iters is unset and the run is shorter (a quick
    # --set train.iters=5), clamped to the run's length with one INFO line
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
    # (1.41x faster on the H100 reference model, benchmarks/log), off on CPU, and off
    # for FP8 on a backend whose FP8 modules do not compile (Backend.fp8_compiles, e.g. te)
    # unless train.cuda_graphs is on
    compile: bool | None = None
    # CUDA graphs of each transformer layer's training forward and backward (Megatron's
    # --enable-cuda-graph), captured on the first step: the host launches one graph per layer
    # instead of every kernel (pays where the host is the bottleneck, as with te; not for local
    # or fp8: benchmarks/log). CUDA, one GPU (no tp/pp/cp/dp), dense layers, no recompute or
    # dropout, not FP8 delayed scaling
    cuda_graphs: bool = False
    # the core attention's kernel: sdpa (PyTorch's F.scaled_dot_product_attention picks: cuDNN's
    # fused attention on Hopper) | fa4 (FlashAttention-4, the flash-attn-4 package, as SDPA's kernel:
    # 12% less attention time than cuDNN on the H100 reference model, benchmarks/log).
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
    # resume from this committed iteration of ckpt.save instead of the latest (e.g. when the latest
    # is corrupt); unset: the latest (Megatron's --ckpt-step)
    load_iteration: int | None = None


@dataclass
class LoggingConfig:
    dir: str = "runs/default"
    interval: int = 1
    tensorboard: bool = False
    callbacks: list = field(default_factory=lambda: ["jsonl"])
    # Dense bf16 matmul peak of one GPU in TFLOP/s, for MFU (0: MFU not reported).
    # 778 is what torch measures on the H100 machines (see benchmarks/log).
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
