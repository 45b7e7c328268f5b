"""BERT-large-shaped masked-LM training: mtl's ``bert`` family beside Hugging Face's
``BertForMaskedLM`` on one GPU, in one call, at the same batch.

Both sides: post-norm BERT (24 layers, hidden 1024, 16 heads, ffn 4096, vocab 30522, sequence
512, token types, padded samples with 15% of the real tokens masked), fp32 weights under bf16
autocast, fused AdamW, gradient clipping at 1.0; ``--compile`` compiles mtl's encoder layers and
HF's model (``torch.compile``), HF attention is ``sdpa``. The step is the model's forward,
backward and update on one micro-batch (no data loader, no data parallelism). Prints tokens/s,
TFLOP/s (mtl's bert FLOP count for both: the same GEMMs) and peak memory, and appends the table
with the command, device and versions to ``--out``.

    python benchmarks/gpu/bench_bert.py --micro-batch 16 --compile --out benchmarks/RESULTS.md
    python benchmarks/gpu/bench_bert.py --tiny --device cpu --iters 3    # checks the script
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from mtl.core.config_io import load_config
from mtl.core.plugins import registry
from mtl.models.bert import build_encoder
from mtl.models.bert.flops import flops_per_iteration
from mtl.parallel.topology import Topology

LARGE = ["model.num_layers=24", "model.hidden_size=1024", "model.num_attention_heads=16", "model.ffn_hidden_size=4096",
         "model.seq_length=512"]
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
        "model.seq_length=64"]
BERT = ["model.family='bert'", "model.norm_position='post'", "model.type_vocab_size=2", "model.normalization='layernorm'",
        "model.norm_eps=1e-12", "model.activation='gelu'", "model.position_embedding='learned'", "model.bias=true",
        "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
VOCAB, MASK_ID = 30522, 103


def batch(b: int, s: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, VOCAB, (b, s), generator=g)
    lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
    real = torch.arange(s)[None, :] < lengths[:, None]
    masked = (torch.rand(b, s, generator=g) < 0.15) & real
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    text = torch.where(masked, torch.full_like(ids, MASK_ID), ids) * real
    types = (torch.arange(s)[None, :] >= lengths[:, None] // 2).long() * real
    return {k: v.to(device) for k, v in dict(text=text, types=types, labels=labels, padding_mask=real.long()).items()}


def mtl_step(cfg, device, compile_layers: bool):
    model = build_encoder(cfg, Topology.single(), registry("backend").get("local")).to(device)
    if compile_layers:
        for layer in model.layers.values():
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x["text"], labels=x["labels"], token_type_ids=x["types"], padding_mask=x["padding_mask"])
        mask = (x["labels"] >= 0).float()
        loss = (out["mlm_loss"] * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def hf_step(cfg, device, compile_model: bool):
    import transformers

    m = cfg.model
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                                     num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size,
                                     max_position_embeddings=m.seq_length, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(config).to(device)
    forward = torch.compile(model) if compile_model else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=x["text"], token_type_ids=x["types"], attention_mask=x["padding_mask"],
                           labels=x["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def measure(step, x, iters: int, skip: int, device) -> tuple[float, float]:
    """(median seconds per step after ``skip`` warm-ups, peak GiB)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step(x).item()  # waits for the step
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times[skip:] or times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("--compile", action="store_true", help="torch.compile both sides")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model, for checking the script")
    parser.add_argument("--out", default=None, help="append the markdown table here")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = load_config(None, [*BERT, *(TINY if args.tiny else LARGE), f"train.micro_batch_size={args.micro_batch}",
                             f"train.global_batch_size={args.micro_batch}", f"train.device='{args.device}'",
                             "data.dataset='bert'"]).resolve(1, VOCAB)
    x = batch(args.micro_batch, cfg.model.seq_length, device)
    tokens = args.micro_batch * cfg.model.seq_length
    flops = flops_per_iteration(cfg)
    rows = []
    for name, build in (("mtl bert", mtl_step), ("HF BertForMaskedLM (sdpa)", hf_step)):
        torch.manual_seed(0)
        seconds, peak = measure(build(cfg, device, args.compile), x, args.iters, args.skip, device)
        rows.append(f"| {name} | {tokens / seconds:,.0f} | {flops / seconds / 1e12:.1f} | {peak:.2f} |")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    import transformers

    table = "\n".join([
        f"### BERT masked LM, {'tiny' if args.tiny else 'BERT-large shape'}, micro-batch {args.micro_batch}, "
        f"{'compiled' if args.compile else 'eager'}, bf16 autocast ({datetime.date.today()})",
        f"`{' '.join(sys.argv)}` on {device_name}; torch {torch.__version__}, transformers {transformers.__version__}",
        "", "| system | tokens/s | TFLOP/s | peak GiB |", "|---|---|---|---|", *rows, ""])
    print(table)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
