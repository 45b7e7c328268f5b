"""Writes a tiny Megatron-Core GPT checkpoint (torch_dist) and the logits of its own forward.

Run as a script (it spawns ``world_size`` processes with gloo on CPU)::

    python megatron_checkpoint_writer.py OUT_DIR --tp 2 --pp 1 [--bare] [--style gpt2]

``OUT_DIR/ckpt`` gets the distributed checkpoint and ``OUT_DIR/reference.pt`` a dict with
``tokens`` [b, s], ``logits`` [b, s, padded_vocab] (gathered over TP, from the last stage)
and ``vocab_size``. The model is Llama style (RMSNorm, SwiGLU, RoPE, GQA, untied output,
no biases) or with ``--style gpt2`` GPT-2 style (LayerNorm, GELU, learned positions, biases,
tied output, GQA kept); fp32. Without ``--bare`` the checkpoint's ``common.pt`` carries a Megatron-LM
style ``args`` namespace, as ``pretrain_gpt.py`` saves it; with ``--bare`` only the model.

Megatron-Core calls a few CUDA functions even on CPU; they are stubbed here (``synchronize``,
``current_device`` and the model-parallel RNG tracker's ``fork``: dropout is 0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

VOCAB_SIZE = 257  # true vocabulary; Megatron pads it to a multiple of 128 * tp
SEQ_LENGTH = 16
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96)
NORM_EPS = 1e-6
ROPE_BASE = 500000


def padded_vocab(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB_SIZE // multiple) * multiple


def stub_cuda() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()


def megatron_args(tp: int, pp: int, gpt2: bool) -> argparse.Namespace:
    """The hyper-parameters as Megatron-LM's training script records them in ``common.pt``."""
    return argparse.Namespace(
        **MODEL,
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
        num_experts=None,
        multi_latent_attention=False,
        padded_vocab_size=padded_vocab(tp),
        make_vocab_size_divisible_by=128,
        max_position_embeddings=SEQ_LENGTH,
        seq_length=SEQ_LENGTH,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
    )


def worker(rank: int, world_size: int, out_dir: str, tp: int, pp: int, bare: bool, gpt2: bool, port: int) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    stub_cuda()

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    config = TransformerConfig(
        **MODEL,
        normalization="LayerNorm" if gpt2 else "RMSNorm",
        layernorm_epsilon=NORM_EPS,
        gated_linear_unit=not gpt2,
        activation_func=F.gelu if gpt2 else F.silu,
        add_bias_linear=gpt2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        init_method_std=0.1,  # larger than the default: a wrong mapping shows in the logits
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    first, last = pp_rank == 0, pp_rank == pp - 1
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="LayerNorm" if gpt2 else "RMSNorm"),
        vocab_size=padded_vocab(tp),
        max_sequence_length=SEQ_LENGTH,
        pre_process=first,
        post_process=last,
        parallel_output=False,  # logits gathered over TP
        share_embeddings_and_output_weights=gpt2,
        position_embedding_type="learned_absolute" if gpt2 else "rope",
        rotary_base=ROPE_BASE,
    )
    with torch.no_grad():  # norm weights start at one, biases at zero; move them so the test sees them
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))

    tokens = torch.randint(0, VOCAB_SIZE, (2, SEQ_LENGTH), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ_LENGTH).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(1, 1, SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), diagonal=1)  # True: masked
    hidden_shape = (SEQ_LENGTH, tokens.shape[0], MODEL["hidden_size"])
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    with torch.no_grad():
        if not first:  # the previous stage's hidden states [s, b, h]
            received = torch.empty(hidden_shape)
            dist.recv(received, group_src=pp_rank - 1, group=pp_group)
            model.set_input_tensor(received)
        output = model(tokens, positions, causal)
        if not last:
            dist.send(output.contiguous(), group_dst=pp_rank + 1, group=pp_group)

    checkpoint = os.path.join(out_dir, "ckpt")
    os.makedirs(checkpoint, exist_ok=True)
    state = {"model": model.sharded_state_dict()}
    if not bare:
        state.update(args=megatron_args(tp, pp, gpt2), checkpoint_version=3.0, iteration=1)
    dist_checkpointing.save(state, checkpoint)
    if last and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save({"tokens": tokens, "logits": output, "vocab_size": VOCAB_SIZE}, os.path.join(out_dir, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--bare", action="store_true", help="no args in common.pt")
    parser.add_argument("--style", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--port", type=int, default=29511)
    a = parser.parse_args(argv)
    world_size = a.tp * a.pp
    torch.multiprocessing.spawn(worker, args=(world_size, a.out_dir, a.tp, a.pp, a.bare, a.style == "gpt2", a.port), nprocs=world_size)


if __name__ == "__main__":
    main(sys.argv[1:])
