"""What both optimizer paths share: AdamW over a list of (possibly partial) parameters with
the weight-decay groups, LR access, state dicts and checkpoint-shaped state."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.core.errors import CheckpointError, ConfigError
from mtl.parallel.optimizer.grad_norm import clip_grad_norm
from mtl.parallel.optimizer.param_groups import uses_weight_decay
from mtl.parallel.optimizer.state_layout import MOMENTS, ensure_adamw_state, flat_global_range
from mtl.parallel.topology import Topology


@dataclass(eq=False)
class StateEntry:
    """One tensor AdamW updates: ``piece`` is ``source.view(-1)[first:first + piece.numel()]``
    (the whole ``source`` for the replicated optimizer, this rank's shard for the distributed one)."""

    piece: nn.Parameter
    source: nn.Parameter
    name: str
    first: int


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    problems = []
    if not lr >= 0:
        problems.append(f"train.lr = {lr!r} must be >= 0")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        problems.append(f"train.adam_beta1/adam_beta2 = {tuple(betas)!r} must each be in [0, 1)")
    if not eps > 0:
        problems.append(f"train.adam_eps = {eps!r} must be > 0")
    if not weight_decay >= 0:
        problems.append(f"train.weight_decay = {weight_decay!r} must be >= 0")
    if problems:
        raise ConfigError("invalid AdamW settings: " + "; ".join(problems))


class AdamWShell:
    """Subclasses provide the entries, ``step()`` and ``zero_grad()``."""

    is_dp_sharded = False

    def __init__(self, entries: list[StateEntry], topology: Topology, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        self.topology = topology
        self.entries = entries
        decay = [e.piece for e in entries if uses_weight_decay(e.name, e.source)]
        no_decay = [e.piece for e in entries if not uses_weight_decay(e.name, e.source)]
        fused = bool(entries) and all(e.piece.is_cuda for e in entries)
        self.inner = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=tuple(betas), eps=eps, fused=True if fused else None,
        )

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's groups (decayed, not decayed): an LR schedule sets ``group["lr"]``."""
        return self.inner.param_groups

    @property
    def model_params(self) -> list[nn.Parameter]:
        """Every model parameter this optimizer updates (once each)."""
        return list({id(e.source): e.source for e in self.entries}.values())

    def clip_grad_norm(self, max_norm: float) -> float:
        """``optimizer.grad_norm.clip_grad_norm`` over this optimizer's parameters."""
        return clip_grad_norm(self.model_params, max_norm, self.topology, grads_are_dp_sharded=self.is_dp_sharded)

    # ---- state -----------------------------------------------------------------------------
    def _layout(self) -> list[tuple[str, int, int]]:
        return [(e.name, e.first, e.piece.numel()) for e in self.entries]

    def state_dict(self) -> dict:
        """For an exact resume at the same layout; use ``sharded_state`` to change layouts."""
        return {"adamw": self.inner.state_dict(), "layout": self._layout()}

    def load_state_dict(self, state_dict: dict) -> None:
        layout = [tuple(x) for x in state_dict.get("layout", [])]
        if layout != self._layout():
            raise CheckpointError(
                f"optimizer state was saved for {len(layout)} tensors in another layout than this "
                f"rank's {len(self.entries)} (different model, parallel sizes or distributed_optimizer "
                "setting); resume through the sharded checkpoint, which reshards"
            )
        self.inner.load_state_dict(state_dict["adamw"])

    def sharded_state(self, prefix: str, param_names: dict | None = None) -> dict:
        """``{name: (tensor, global_shape, global_offset)}`` of this rank's AdamW moments.

        Names are ``{prefix}.{param name}.exp_avg|exp_avg_sq``, the parameter name taken from
        ``param_names[param]`` when given (pass global names with pipeline parallelism), else
        the local one. Tensors are 1-D views of the live state (loading into them in place
        restores it); ranges follow ``state_layout``. The step count is in ``common_state()``."""
        out = {}
        for e in self.entries:
            state = ensure_adamw_state(self.inner, e.piece)
            name = param_names.get(e.source, e.name) if param_names else e.name
            global_shape, global_offset = flat_global_range(e.source, e.first, self.topology)
            for moment in MOMENTS:
                out[f"{prefix}.{name}.{moment}"] = (state[moment].view(-1), global_shape, global_offset)
        return out

    def common_state(self) -> dict:
        """What every rank holds alike: the number of steps taken."""
        steps = {int(self.inner.state[e.piece]["step"]) for e in self.entries if self.inner.state[e.piece]}
        return {"step": steps.pop() if steps else 0}

    def load_common_state(self, common: dict) -> None:
        for e in self.entries:
            ensure_adamw_state(self.inner, e.piece)["step"].fill_(float(common["step"]))
