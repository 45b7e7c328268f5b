"""Bad steps: a NaN/Inf loss or gradient norm, found where it first appears.

``LossWatch`` hooks the last pipeline stage's model output (the per-token loss) and keeps a
device-side flag that any micro-batch of the step produced a non-finite loss, so the rank
where the trouble started is known although the reported loss is already averaged over
data-parallel ranks. Reading it costs nothing extra: the step's loss is read anyway."""

from __future__ import annotations

import torch

from mtl.core.errors import MtlError


class NonFiniteError(MtlError):
    """A step produced a NaN/Inf loss or gradient norm (more of them than train.skip_bad_steps allows)."""


class LossWatch:
    def __init__(self, chunks: list, is_last_stage: bool, device: torch.device):
        self._flag = torch.zeros((), dtype=torch.bool, device=device)
        self._handles = []
        if is_last_stage:
            last = chunks[-1]
            self._handles.append(getattr(last, "module", last).register_forward_hook(self._hook))

    def _hook(self, module, args, output) -> None:
        if torch.is_tensor(output) and output.is_floating_point():
            self._flag |= ~torch.isfinite(output.detach()).all()

    def reset(self) -> None:
        self._flag.zero_()

    def fired(self) -> bool:
        return bool(self._flag.item())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
