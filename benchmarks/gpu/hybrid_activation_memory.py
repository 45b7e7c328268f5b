"""A Mamba-2 layer's activation memory at the hybrid reference shapes against ``--dry-run``'s count
(``mtl.models.hybrid.memory``), in one call (issue 36): the bytes autograd saves for one layer's
backward (distinct storages, parameters left out) and the allocator's growth over its forward, with
mtl's PyTorch scan and, where mamba-ssm is installed, its Triton scan (which keeps fewer tensors:
the count is the PyTorch scan's, an upper bound there).

    python3 benchmarks/gpu/hybrid_activation_memory.py [--seq 4096] [--device cuda]

Shapes: hybrid_reference.toml (hidden 2048, 64 heads of 64 in 8 groups, state 128, chunk 128),
micro-batch 2, bf16 weights under bf16 autocast, as training runs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mtl.core.config_io import load_config
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.hybrid.memory import activation_bytes_per_layer
from mtl.models.mamba import dispatch
from mtl.parallel.topology import Topology

REFERENCE = Path(__file__).with_name("hybrid_reference.toml")


def measure(layer: torch.nn.Module, hidden: torch.Tensor) -> tuple[int, int]:
    """(saved bytes, allocator growth in bytes) of one forward kept for backward."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and tensor.dim() > 1:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    synchronize = torch.cuda.synchronize if hidden.is_cuda else (lambda: None)
    synchronize()
    before = torch.cuda.memory_allocated() if hidden.is_cuda else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(hidden.device.type, torch.bfloat16):
            out = layer(hidden)
    synchronize()
    grown = (torch.cuda.memory_allocated() - before - out.numel() * out.element_size()) if hidden.is_cuda else 0
    return sum(kept.values()), grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    cfg = load_config(REFERENCE, [f"model.seq_length={args.seq}", f"train.device='{args.device}'"])
    cfg = cfg.resolve(world_size=1, tokenizer_vocab_size=256)
    family, backend = registry("model family").get("hybrid"), registry("backend").get("local")
    model = build_model(family, cfg, Topology.single(), backend)
    layer = next(m for m in model.modules() if getattr(m, "symbol", None) == "M").to(args.device, torch.bfloat16)
    hidden = torch.randn(args.seq, cfg.train.micro_batch_size, cfg.model.hidden_size, device=args.device,
                         dtype=torch.bfloat16, requires_grad=True)
    estimate = activation_bytes_per_layer(cfg)[layer.layer_number]
    kernels = {"pytorch scan": None}
    if args.device == "cuda" and dispatch.mamba_ssm_kernel() is not None:
        kernels["mamba-ssm scan"] = dispatch.mamba_ssm_kernel()
    print("| scan | saved MiB | allocator growth MiB | --dry-run MiB | estimate / saved |\n|---|---|---|---|---|")
    for name, kernel in kernels.items():
        dispatch.register_cuda_scan(kernel)
        saved, grown = measure(layer, hidden)
        mib = 2**20
        print(f"| {name} | {saved / mib:.1f} | {grown / mib:.1f} | {estimate / mib:.1f} | {estimate / saved:.2f} |")


if __name__ == "__main__":
    main()
