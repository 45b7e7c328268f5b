"""One transformer layer of the reference model, forward + backward, compiled: mtl's layer
against the plain-PyTorch peer's block, with the kernels of each (issue 11).

    python3 benchmarks/gpu/layer_bench.py [--variants base rope-qkv no-rope peer] [--inductor NAME=VALUE] [--out FILE]

The step's time is 192 layer calls (24 layers x 8 micro-batches) plus the head, loss and
optimizer, so a per-layer difference of 0.1 ms is 19 ms per step. Each variant builds the
layer as the trainer does (``mtl.train.setup``: bf16 weights, fp32 ``main_grad`` written by
the weight-gradient GEMMs, ``train.compile``), times ``--iters`` forward + backward calls on
a random ``[s, b, h]`` input, then profiles a few and lists the kernels per call.

Variants (monkeypatches of this process only, to measure before changing mtl):
- ``base``: mtl as it is;
- ``rope-qkv``: RoPE applied to q and k together in the fused QKV output's own layout
  ``[s, b, groups, heads_per_group + 2, d]``, before the transpose to batch-first;
- ``no-rope``: no rotation at all (not a valid model: the bound on what RoPE costs);
- ``peer``: ``peer_model.Block`` (batch-first, fp32 weights under bf16 autocast), compiled.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

REFERENCE = HERE / "llama_reference.toml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to check the script


def rope_qkv_forward(self, hidden, rotary, inference_context=None):
    """SelfAttention.forward with the rotation applied before the layout change."""
    from mtl.models.gpt.rope import rotate_half

    qkv = self.linear_qkv(hidden)
    s, b = qkv.shape[0], qkv.shape[1]
    qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
    qk, value = qkv[:, :, :, : self.heads_per_group + 1], qkv[:, :, :, self.heads_per_group + 1]
    cos, sin = (t.transpose(0, 1)[:, :, :, None].to(qk.dtype) for t in rotary)  # [s, b, 1, 1, d]
    qk = qk * cos + rotate_half(qk) * sin
    query = qk[:, :, :, : self.heads_per_group].reshape(s, b, self.local_heads, self.head_dim)
    key = qk[:, :, :, self.heads_per_group]
    query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    context = self.core_attention(query, key, value)
    context = context.transpose(0, 1).reshape(s, b, self.local_heads * self.head_dim)
    return self.linear_proj(context)


def mtl_layer(variant: str, sets: list[str]):
    from mtl.core.config_io import load_config
    from mtl.models.gpt import attention
    from mtl.train.setup import setup

    if variant == "rope-qkv":
        attention.SelfAttention.forward = rope_qkv_forward
    run = setup(load_config(str(REFERENCE), ["model.num_layers=1", "train.compile=true", f"train.device='{DEVICE}'", *sets]))
    cfg = run.config
    model = run.chunks[0].module if hasattr(run.chunks[0], "module") else run.chunks[0]
    layer = next(iter(model.layers.values()))
    # under train.compile the compiled unit is the layer's deferred-residual step (residual_deferral.py)
    step = model.compile_units()[0]
    s, b, h = cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size
    x = torch.randn(s, b, h, device=DEVICE, dtype=next(layer.parameters()).dtype, requires_grad=True)
    grad = torch.randn_like(x)
    positions = torch.arange(s, device=DEVICE).expand(b, s)
    rotary = None if variant == "no-rope" else model.rotary(positions)

    ddp = run.chunks[0]

    def call():  # inside no_sync, as every micro-batch but the last: no gradient reduction
        with ddp.no_sync():
            hidden, mlp_out = step(x, torch.zeros_like(x).requires_grad_(), rotary)
            (hidden + mlp_out).backward(grad)

    return call


def peer_block(sets: list[str]):
    from mtl.core.config_io import load_config
    from peer_model import Block, rope_tables

    cfg = load_config(str(REFERENCE), sets).resolve(1, 257)
    m = cfg.model
    block = Block(m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.ffn_hidden_size,
                  m.norm_eps).to(DEVICE)
    block.compile()
    b, s = cfg.train.micro_batch_size, m.seq_length
    cos, sin = rope_tables(s, m.head_dim, m.rope_theta, DEVICE)
    x = torch.randn(b, s, m.hidden_size, device=DEVICE, requires_grad=True)
    grad = torch.randn_like(x)

    def call():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = block(x, cos, sin)
        y.backward(grad)

    return call


def set_inductor(items: list[str]) -> None:
    import ast
    import functools

    import torch._inductor.config as inductor_config

    for item in items:
        name, value = item.split("=", 1)
        *path, leaf = name.split(".")
        owner = functools.reduce(getattr, path, inductor_config)
        if not hasattr(owner, leaf):
            raise SystemExit(f"--inductor {item!r}: torch._inductor.config has no {name!r}")
        setattr(owner, leaf, ast.literal_eval(value))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(call, iters: int) -> float:
    for _ in range(3):  # compile, then warm
        call()
    sync()
    began = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - began) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=["base", "rope-qkv", "no-rope", "peer"])
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                        help="set torch._inductor.config.NAME (dotted, VALUE a Python literal) before compiling")
    args = parser.parse_args()
    from profile_step import gemm_table, kernel_table, profile_steps

    if len(args.variants) > 1:  # each variant in its own process: monkeypatches and caches stay apart
        import subprocess

        for v in args.variants:
            cmd = [sys.executable, __file__, "--variants", v, "--iters", str(args.iters), "--rows", str(args.rows),
                   *(f"--set={s}" for s in args.sets), *(f"--inductor={i}" for i in args.inductor),
                   *(["--out", f"{args.out}.{v}"] if args.out else [])]
            subprocess.run(cmd, check=False)
        return
    variant = args.variants[0]
    set_inductor(args.inductor)
    call = peer_block(args.sets) if variant == "peer" else mtl_layer(variant, args.sets)
    ms = timed(call, args.iters)
    prof = profile_steps(call, warmup=1, steps=5, record_shapes=True)
    table = kernel_table(prof, steps=5, rows=args.rows, title=f"{variant}: one layer, forward + backward")
    text = (f"## {variant}: {ms:.3f} ms per layer forward + backward (mean of {args.iters})\n\n{table}\n"
            f"GEMMs by shape, per call:\n\n{gemm_table(prof, steps=5)}")
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
