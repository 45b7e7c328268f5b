"""The per-chunk elementwise work of the fused LM head + cross-entropy (linear_cross_entropy.py):
the log-sum-exp and target logit of a chunk of logits in the forward, and ``dlogits = (softmax -
onehot(target)) * grad_loss`` in the backward (into a new tensor, or over the kept logits).

Each has two forms with the same numbers: a plain one that ``torch.compile`` turns into one
kernel (``compile=True``), and an eager one written for the fewest passes over the fp32 chunk
that eager mode allows. ``CHUNK_KERNELS`` picks between them and falls back to the eager ones,
once and with one log line, should compilation fail.
"""

from __future__ import annotations

import torch

from mtl.core.log import get_logger

log = get_logger(__name__)


def _chunk_stats(logits: torch.Tensor, target_local: torch.Tensor, owned: torch.Tensor, num_real: int):
    """logits [c, V/tp] (compute dtype) -> (log-sum-exp over the first ``num_real`` columns,
    the target's logit where ``owned`` else 0), both [c] fp32."""
    tgt = logits.gather(-1, target_local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~owned, 0.0)
    real = logits[:, :num_real].float()
    row_max = real.amax(dim=-1)
    lse = torch.log(torch.exp(real - row_max.unsqueeze(-1)).sum(dim=-1)) + row_max
    return lse, tgt


def _chunk_stats_eager(logits, target_local, owned, num_real):
    # The same math as _chunk_stats with the fewest passes eager mode allows: the max of the
    # compute-dtype logits is exact, and ``logits - max`` promotes to fp32 in the same pass
    # (no separate upcast); exp and the sum follow in place. 2 bytes read, then ~4+4+4+4 per
    # element, against ~2+4+4+8+8+4 for upcast, max, subtract, exp, sum.
    tgt = logits.gather(-1, target_local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~owned, 0.0)
    real = logits[:, :num_real]
    row_max = real.amax(dim=-1, keepdim=True).float()
    lse = torch.sub(real, row_max).exp_().sum(dim=-1).log_().add_(row_max.squeeze(-1))
    return lse, tgt


def _chunk_dlogits(logits, lse, target_local, owned, scale, num_real: int, out_dtype: torch.dtype):
    """(softmax - onehot(target)) * scale per row, padding columns zero, in ``out_dtype``."""
    p = torch.exp(logits.float() - lse.unsqueeze(-1))
    col = torch.arange(logits.shape[-1], device=logits.device)
    if num_real < logits.shape[-1]:
        p = torch.where(col < num_real, p, 0.0)
    onehot = (col == target_local.unsqueeze(-1)) & owned.unsqueeze(-1)
    return ((p - onehot.float()) * scale.unsqueeze(-1)).to(out_dtype)


def _softmax_minus_onehot_eager(logits, lse, target_local, owned, num_real):
    # ``logits - lse`` promotes to fp32 as it reads, exp in place, the target's one subtracted:
    # the fp32 rows of softmax - onehot, padding columns zero, in a new tensor (so the caller
    # may write the result over ``logits``)
    p = torch.sub(logits, lse.unsqueeze(-1)).exp_()
    if num_real < p.shape[-1]:
        p[:, num_real:] = 0.0
    return p.scatter_add_(-1, target_local.unsqueeze(-1), -owned.to(p.dtype).unsqueeze(-1))


def _chunk_dlogits_eager(logits, lse, target_local, owned, scale, num_real, out_dtype):
    # As _chunk_dlogits in three passes, the scaling writing straight into the compute dtype
    # (rounded once, from fp32).
    p = _softmax_minus_onehot_eager(logits, lse, target_local, owned, num_real)
    if out_dtype == p.dtype:
        return p.mul_(scale.unsqueeze(-1))
    return torch.mul(p, scale.unsqueeze(-1), out=torch.empty(p.shape, dtype=out_dtype, device=p.device))


def _chunk_dlogits_into(out, logits, lse, target_local, owned, scale, num_real: int):
    """``_chunk_dlogits`` written into ``out`` (which may be ``logits`` itself): compiled, the
    read of the logits and the write of their gradient are one kernel."""
    out.copy_(_chunk_dlogits(logits, lse, target_local, owned, scale, num_real, out.dtype))
    return out


def _chunk_dlogits_into_eager(out, logits, lse, target_local, owned, scale, num_real):
    # As _chunk_dlogits_eager, its last pass writing into ``out`` (which may be the logits).
    p = _softmax_minus_onehot_eager(logits, lse, target_local, owned, num_real)
    return torch.mul(p, scale.unsqueeze(-1), out=out)


class _Kernels:
    """The eager kernels, and their compiled forms built on first use; a failed compilation
    is logged once and the eager kernels used from then on. Index 0: chunk statistics,
    1: chunk ``dlogits``, 2: chunk ``dlogits`` into a given buffer."""

    def __init__(self):
        self._compiled = None
        self._failed = False

    def get(self, compiled: bool):
        if compiled and not self._failed:
            if self._compiled is None:
                self._compiled = (
                    torch.compile(_chunk_stats, dynamic=False),
                    torch.compile(_chunk_dlogits, dynamic=False),
                    torch.compile(_chunk_dlogits_into, dynamic=False),
                )
            return self._compiled
        return _chunk_stats_eager, _chunk_dlogits_eager, _chunk_dlogits_into_eager

    def run(self, index: int, compiled: bool, *args):
        if compiled and not self._failed:
            try:
                return self.get(True)[index](*args)
            except torch.OutOfMemoryError:
                raise  # not a compilation problem
            except Exception as exc:  # noqa: BLE001 - an optimisation failing must not stop training
                self._failed = True
                log.warning("fused cross-entropy: torch.compile of the chunk kernels failed (%s: %s); "
                            "running them eagerly", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return self.get(False)[index](*args)


CHUNK_KERNELS = _Kernels()  # shared by every call: compiled once per process
