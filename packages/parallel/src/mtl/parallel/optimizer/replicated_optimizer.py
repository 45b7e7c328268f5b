"""AdamW with the full optimizer state on every data-parallel rank (no ZeRO)."""

from __future__ import annotations

from torch import nn

from mtl.parallel.ddp import DataParallel
from mtl.parallel.optimizer.adamw_shell import AdamWShell, StateEntry, main_copy
from mtl.parallel.topology import Topology


def _chunk_entries(chunks: list[nn.Module]) -> list[StateEntry]:
    entries: list[StateEntry] = []
    seen: set[int] = set()
    for c, chunk in enumerate(chunks):
        module = chunk.module if isinstance(chunk, DataParallel) else chunk
        for name, param in module.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                name = name if len(chunks) == 1 else f"chunk{c}.{name}"
                main_grad = getattr(param, "main_grad", None)  # lower-precision weights (DataParallel)
                if main_grad is None:
                    entries.append(StateEntry(param, param, name, 0))
                else:
                    entries.append(StateEntry(main_copy(param, main_grad), param, name, 0, model_view=param.data))
    return entries


class ReplicatedOptimizer(AdamWShell):
    """AdamW over every parameter of ``chunks`` (plain modules or ``DataParallel`` wrappers),
    with the weight-decay groups of ``param_groups.py``: torch's fused AdamW, or on CUDA with
    bf16/fp16 weights the one-pass Triton kernel that also writes the model weights
    (``AdamWShell.update_weights``)."""

    def __init__(self, chunks: list[nn.Module], topology: Topology, *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.chunks = list(chunks)
        super().__init__(_chunk_entries(self.chunks), topology, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)

    def step(self) -> None:
        for chunk in self.chunks:
            if isinstance(chunk, DataParallel):
                chunk.finish_grad_sync()  # a no-op when the training loop already did it
        self.update_weights()  # AdamW and main -> model weights (one Triton pass on CUDA, see AdamWShell)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.chunks:
            if isinstance(chunk, DataParallel):
                chunk.zero_grad()  # grads are views of its buffer: zero in place
            else:
                for p in chunk.parameters():
                    if set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()
