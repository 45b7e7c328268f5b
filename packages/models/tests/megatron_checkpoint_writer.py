"""Megatron-Core itself on CPU/gloo: writes tiny GPT checkpoints (torch_dist) with the logits of
its own forward, and loads checkpoints (ours) into a GPTModel built from their saved args.

Write (run as a script: it spawns ``--world-size`` processes, once for every job)::

    python megatron_checkpoint_writer.py --write JOBS.json --world-size 2

each job ``{"out": OUT_DIR, "tp": 2, "pp": 1, "bare": false, "style": STYLE, "singleton":
false}`` (a job on fewer ranks than the world runs as data-parallel replicas):
``OUT_DIR/ckpt`` gets the distributed checkpoint and ``OUT_DIR/reference.pt`` a dict with
``tokens`` [b, s], ``logits`` [b, s, padded_vocab] (gathered over TP, from the last stage)
and ``vocab_size``. Styles: ``llama`` (RMSNorm, SwiGLU, RoPE, GQA, untied, no biases),
``gpt2`` (LayerNorm, GELU, learned positions, biases, tied, GQA kept), ``moe`` (llama with
experts in layers 1 and 3 and a gated shared expert: one key per layer) and ``moe_all``
(experts in every layer: keys stacked over layers). ``--singleton`` saves with Megatron's
``singleton_local_shards`` (one key per expert, gated fc1 halves apart). Without ``--bare``
``common.pt`` carries a Megatron-LM style ``args`` namespace, as ``pretrain_gpt.py`` saves it.

Load::

    python megatron_checkpoint_writer.py --load JOBS.json --world-size 2

each job ``{"ckpt": DIR, "tp": N, "te": bool, "out": FILE}``: a GPTModel of Megatron-Core's
local spec built from ``DIR/common.pt``'s args at tp = N (world size / N data-parallel
copies), ``dist_checkpointing.load`` of its sharded state dict, and its logits on tokens
below ``args.vocab_size`` saved to FILE. ``te``: the checkpoint follows the Transformer-Engine
spec's keys, which CPU cannot build (no TE); the local modules' sharded state dict is renamed
to them (an MoE layer's ``pre_mlp_layernorm``) and asks for TE's ``_extra_state`` objects too.

``--real-te`` (GPUs with Transformer Engine, one per rank): the TE-named jobs load into a
GPTModel of Megatron-Core's TE spec itself (``MTL_MEGATRON_REAL_TE=1`` makes the export test
pass it).

Megatron-Core calls a few CUDA functions even on CPU; they are stubbed here (``synchronize``,
``current_device`` and the model-parallel RNG tracker's ``fork``: dropout is 0), and the MoE
router's Transformer-Engine GEMM name is defined as None (its torch path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys

import torch

VOCAB_SIZE = 257  # true vocabulary; Megatron pads it to a multiple of 128 * tp
SEQ_LENGTH = 16
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96)
NORM_EPS = 1e-6
ROPE_BASE = 500000
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=80,
           moe_shared_expert_gate=True, moe_router_pre_softmax=False, moe_router_score_function="softmax",
           moe_aux_loss_coeff=0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def padded_vocab(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB_SIZE // multiple) * multiple


def stub_cuda() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 without Transformer Engine leaves this name undefined (its import
    # fails) and the router's matmul then raises NameError; None selects its torch.mm path
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def megatron_args(tp: int, pp: int, style: str) -> argparse.Namespace:
    """The hyper-parameters as Megatron-LM's training script records them in ``common.pt``."""
    gpt2 = style == "gpt2"
    moe = {}
    if style.startswith("moe"):
        moe = dict(MOE, moe_layer_freq=1 if style == "moe_all" else [0, 1, 0, 1])
        if style == "moe":
            moe["vocab_size"] = VOCAB_SIZE  # as a run with --vocab-size records it
    return argparse.Namespace(
        **MODEL,
        **(moe or {"num_experts": None}),
        group_query_attention=True,
        kv_channels=MODEL["hidden_size"] // MODEL["num_attention_heads"],
        normalization="LayerNorm" if gpt2 else "RMSNorm",
        norm_epsilon=NORM_EPS,
        swiglu=not gpt2,
        squared_relu=False,
        position_embedding_type="learned_absolute" if gpt2 else "rope",
        rotary_base=ROPE_BASE,
        rotary_percent=1.0,
        use_rope_scaling=False,
        untie_embeddings_and_output_weights=not gpt2,
        add_bias_linear=gpt2,
        add_qkv_bias=False,
        qk_layernorm=False,
        apply_layernorm_1p=False,
        multi_latent_attention=False,
        padded_vocab_size=padded_vocab(tp),
        make_vocab_size_divisible_by=128,
        max_position_embeddings=SEQ_LENGTH,
        seq_length=SEQ_LENGTH,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )


def build_model(args: argparse.Namespace, tp: int, pp: int, te: bool = False):
    """A GPTModel of Megatron-Core's local spec (``te``: its Transformer-Engine spec, on the
    GPU) from Megatron-LM ``args`` (what Megatron-LM's ``core_transformer_config_from_args`` +
    ``model_provider`` take from them), fp32."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if getattr(args, "num_experts", None):
        moe = {k: getattr(args, k) for k in MOE if k != "num_experts" and hasattr(args, k)}
        moe.update(num_moe_experts=args.num_experts, moe_layer_freq=args.moe_layer_freq,
                   moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather")
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=not te, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        init_method_std=0.1,  # larger than the default: a wrong mapping shows in the logits
        **moe,
    )
    if moe:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=args.normalization)
    elif te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return GPTModel(
        config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
        parallel_output=False,  # logits gathered over TP
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rope_scaling=getattr(args, "use_rope_scaling", False), rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
    )


def forward(model, tokens: torch.Tensor, hidden_size: int, pp: int) -> torch.Tensor:
    """The model's logits (on the last stage; hidden states passed between stages)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    seq, device = tokens.shape[1], tokens.device
    positions = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)  # True: masked
    pp_rank, pp_group = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_group()
    model.eval()
    with torch.no_grad():
        if pp_rank > 0:  # the previous stage's hidden states [s, b, h]
            received = torch.empty(seq, tokens.shape[0], hidden_size, device=device)
            dist.recv(received, group_src=pp_rank - 1, group=pp_group)
            model.set_input_tensor(received)
        output = model(tokens, positions, causal)
        if pp_rank < pp - 1:
            dist.send(output.contiguous(), group_dst=pp_rank + 1, group=pp_group)
    return output


def init(rank: int, world_size: int, port: int, gpu: bool = False) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if gpu:  # one GPU per rank, NCCL: what Transformer Engine's modules need
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
        return
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    stub_cuda()


def write_worker(rank, world_size, jobs, port) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    init(rank, world_size, port)
    for job in jobs:  # a job smaller than the world runs as data-parallel replicas
        tp, pp, style = job.get("tp", 1), job.get("pp", 1), job.get("style", "llama")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        torch.manual_seed(1234)
        args = megatron_args(tp, pp, style)
        model = build_model(args, tp, pp)
        with torch.no_grad():  # norm weights start at one, biases at zero; move them so the test sees them
            for name, param in model.named_parameters():
                if "layernorm" in name or name.endswith("bias"):
                    param.add_(0.1 * torch.randn_like(param))
        tokens = torch.randint(0, VOCAB_SIZE, (2, SEQ_LENGTH), generator=torch.Generator().manual_seed(0))
        output = forward(model, tokens, MODEL["hidden_size"], pp)
        checkpoint = os.path.join(job["out"], "ckpt")
        os.makedirs(checkpoint, exist_ok=True)
        metadata = {"singleton_local_shards": True} if job.get("singleton") else None
        state = {"model": model.sharded_state_dict(metadata=metadata)}
        if not job.get("bare"):
            state.update(args=args, checkpoint_version=3.0, iteration=1)
        dist_checkpointing.save(state, checkpoint)
        if (parallel_state.get_pipeline_model_parallel_rank() == pp - 1 and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0):
            torch.save({"tokens": tokens, "logits": output, "vocab_size": VOCAB_SIZE},
                       os.path.join(job["out"], "reference.pt"))
        parallel_state.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


def te_named(sharded: dict, args) -> dict:
    """The local modules' sharded state dict under the TE spec's keys, with TE's extra states."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    requested = dict(sharded)
    for name, tensor in sharded.items():
        layer = name.split("pre_mlp_layernorm.")[0]
        if ".pre_mlp_layernorm." in name and layer + "mlp.router.weight" in sharded:  # an MoE layer
            tensor.key = tensor.key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    moe = getattr(args, "num_experts", None)
    stacked = not moe or not isinstance(args.moe_layer_freq, list)
    for layer in range(args.num_layers):  # TE's attention kernel has an extra state; the local one none
        prefix, offset, shape = ("decoder.layers.", (layer,), (args.num_layers,)) if stacked else \
            (f"decoder.layers.{layer}.", (0,), (1,))
        requested[f"te_extra/{layer}"] = ShardedObject(f"{prefix}self_attention.core_attention._extra_state", None,
                                                       shape, offset, replica_id=torch.distributed.get_rank())
    return requested


def load_worker(rank, world_size, jobs, port, real_te) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    init(rank, world_size, port, gpu=real_te)
    for job in jobs:
        args = torch.load(os.path.join(job["ckpt"], "common.pt"), weights_only=False)["args"]
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=job["tp"])
        torch.manual_seed(99)  # other weights than the checkpoint's: the load must replace them all
        model = build_model(args, job["tp"], 1, te=real_te and job["te"])
        if real_te:
            model.cuda()
        sharded = model.sharded_state_dict()
        if job["te"] and not real_te:
            sharded = te_named(sharded, args)
        loaded = dist_checkpointing.load({"model": sharded}, job["ckpt"])["model"]  # as Megatron-LM nests it
        extra = {k: loaded.pop(k) for k in list(loaded) if k.startswith("te_extra/")}
        assert all(v is None for v in extra.values()), "TE's extra states should hold None"
        model.load_state_dict(loaded, strict=True)
        tokens = torch.randint(0, args.vocab_size, (2, SEQ_LENGTH), generator=torch.Generator().manual_seed(0))
        output = forward(model, tokens.to("cuda" if real_te else "cpu"), args.hidden_size, 1).cpu()
        if rank == 0:
            torch.save({"tokens": tokens, "logits": output, "extra_states": len(extra), "real_te": real_te}, job["out"])
        parallel_state.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="a JSON file of write jobs")
    parser.add_argument("--load", help="a JSON file of load jobs")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--real-te", action="store_true",
                        help="--load on GPUs (NCCL, one per rank), TE-named jobs into the Transformer-Engine spec")
    parser.add_argument("--port", type=int, default=29511)
    a = parser.parse_args(argv)
    if bool(a.write) == bool(a.load):
        parser.error("give one of --write JOBS.json or --load JOBS.json")
    if a.write:
        jobs = json.loads(open(a.write).read())
        torch.multiprocessing.spawn(write_worker, args=(a.world_size, jobs, a.port), nprocs=a.world_size)
    else:
        jobs = json.loads(open(a.load).read())
        torch.multiprocessing.spawn(load_worker, args=(a.world_size, jobs, a.port, a.real_te), nprocs=a.world_size)


if __name__ == "__main__":
    main(sys.argv[1:])
