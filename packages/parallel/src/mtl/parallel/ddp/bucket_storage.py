"""Memory a bucket allocates and frees as it goes (ZeRO-2 gradients, ZeRO-3 parameters).

A bucket's full gradient (under ``sharding = "gradients"``) or full parameters (under
``"parameters"``) are one tensor of their own whose storage is resized to nothing when the
bucket does not need it and back when it does. Views of it (the parameters' ``.data``) keep
their shapes meanwhile, so autograd's saved references to a weight see the weight again once
it is gathered for the backward. ``HeldBytes`` counts what is allocated: the tensors, not an
allocator's cache, so CPU and CUDA report the same number.
"""

from __future__ import annotations

import torch


class HeldBytes:
    """Bytes of the buffers' storage held now, and the most held at once since ``reset_peak``."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        self.peak = self.now


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def allocate(tensor: torch.Tensor, held: HeldBytes, zero: bool = False) -> None:
    """Give a freed bucket tensor its storage back (uninitialised unless ``zero``)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        nbytes = tensor.numel() * tensor.element_size()
        storage.resize_(nbytes)
        held.add(nbytes)
    if zero:
        tensor.zero_()


def free(tensor: torch.Tensor, held: HeldBytes) -> None:
    """Release a bucket tensor's storage; its views keep their shapes, not their data."""
    storage = tensor.untyped_storage()
    if storage.nbytes():
        held.add(-storage.nbytes())
        storage.resize_(0)


def new_held(numel: int, dtype: torch.dtype, device: torch.device, held: HeldBytes) -> torch.Tensor:
    """A zeroed tensor counted in ``held`` (persistent shards, flat buffers)."""
    tensor = torch.zeros(numel, dtype=dtype, device=device)
    held.add(tensor.numel() * tensor.element_size())
    return tensor
