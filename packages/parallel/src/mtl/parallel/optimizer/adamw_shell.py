"""What both optimizer paths share: AdamW over a list of (possibly partial) parameters with
the weight-decay groups, LR access, state dicts and checkpoint-shaped state."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from mtl.core.errors import CheckpointError, ConfigError, ParallelError
from mtl.parallel.optimizer import triton_adamw
from mtl.parallel.optimizer.grad_norm import CLIP_EPS, clip_grad_norm, global_grad_norm
from mtl.parallel.optimizer.param_groups import uses_weight_decay
from mtl.parallel.optimizer.state_layout import MOMENTS, MomentPiece, ensure_adamw_state
from mtl.parallel.topology import Topology


@dataclass(eq=False)
class StateEntry:
    """One tensor AdamW updates: ``piece`` is ``source.view(-1)[first:first + piece.numel()]``
    (the whole ``source`` for the replicated optimizer, this rank's shard for the distributed one).

    Under bf16/fp16 weights ``piece`` is instead an fp32 main copy of that range (its grad the
    fp32 ``main_grad``), and ``model_view`` the weights' own storage of the same range, which
    receives the updated main values after every step."""

    piece: nn.Parameter
    source: nn.Parameter
    name: str
    first: int
    model_view: torch.Tensor | None = None


def main_copy(model_range: torch.Tensor, grad: torch.Tensor) -> nn.Parameter:
    """An fp32 main parameter for ``model_range`` (lower-precision weights), with ``grad``
    (the fp32 accumulated gradient of the same range) as its gradient."""
    piece = nn.Parameter(model_range.detach().float().clone())
    piece.grad = grad
    return piece


MAIN_PARAM = "main_param"  # the fp32 main weights, described for checkpoints like a moment


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
    """Subclasses provide the entries, ``step()`` and ``zero_grad()``.

    The update itself (``update_weights``) is torch's fused AdamW over ``self.inner``, then a
    copy of the fp32 main weights into the bf16/fp16 model weights. On CUDA with main weights
    for every entry (contiguous bf16/fp16 model storage) and triton installed, it is instead
    one Triton kernel per tensor that does both in one pass over memory, with torch's
    arithmetic and torch's optimizer state (``triton_adamw``)."""

    is_dp_sharded = False
    shard_group = "dp_cp"  # the topology group (or a group) the gradient shards split over

    def __init__(self, entries: list[StateEntry], topology: Topology, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        self.topology = topology
        self.entries = entries
        decay = [e.piece for e in entries if uses_weight_decay(e.name, e.source)]
        no_decay = [e.piece for e in entries if not uses_weight_decay(e.name, e.source)]
        # The fused kernel (CUDA and CPU) takes the clip coefficient and the skip flag as device
        # tensors (``clip_and_step``); a rank with nothing to update has no kernel to give them to.
        device_types = sorted({e.piece.device.type for e in entries})
        if len(device_types) > 1:
            raise ParallelError(f"AdamW got parameters on several device types ({', '.join(device_types)}); "
                                "move the whole model to one device before building the optimizer")
        self.fused = bool(entries)
        self.inner = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=tuple(betas), eps=eps, fused=True if self.fused else None,
        )
        self.uses_triton_adamw = triton_adamw.supports(entries)

    @property
    def has_main_params(self) -> bool:
        """True when AdamW updates fp32 main copies of lower-precision model weights."""
        return any(e.model_view is not None for e in self.entries)

    @property
    def state_names(self) -> tuple[str, ...]:
        """What ``state_pieces``/``full_moments`` describe: the moments, and the main weights
        where they exist (a checkpoint stores those as the model's weights, in fp32)."""
        return MOMENTS + ((MAIN_PARAM,) if self.has_main_params else ())

    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        """The updated (or loaded) main weights into the model's lower-precision weights."""
        pairs = [(e.model_view, e.piece) for e in self.entries if e.model_view is not None]
        if pairs:
            torch._foreach_copy_([m for m, _ in pairs], [p.detach().view_as(m) for m, p in pairs])

    @torch.no_grad()
    def update_weights(self) -> None:
        """The local update: AdamW on this rank's pieces (with ``clip_and_step``'s grad_scale
        and found_inf), and the new main weights into the model weights."""
        grad_scale = getattr(self.inner, "grad_scale", None)
        found_inf = getattr(self.inner, "found_inf", None)
        if self.uses_triton_adamw and self._triton_can_step():
            # In place of ``self.inner.step()``, inside the wrapper torch puts around every
            # optimizer's step: the step hooks (``register_optimizer_step_pre_hook`` and the
            # rest) run as they would for torch's update, and code outside mtl.parallel relies
            # on them (mtl-quant marks its FP8 weight caches stale in one: without it the
            # forwards kept quantizing the first step's weights).
            def triton_step(optimizer: torch.optim.Optimizer) -> None:
                triton_adamw.adamw_step(optimizer, self.entries, grad_scale, found_inf)

            torch.optim.Optimizer.profile_hook_step(triton_step)(self.inner)
        else:
            self.inner.step()
            self.copy_main_to_model()

    def _triton_can_step(self) -> bool:
        # Settings the kernel does not implement (possibly restored by load_state_dict), and a
        # tensor LR (reading it on the host would wait for the device): torch's path.
        return all(not isinstance(g["lr"], torch.Tensor) and not g.get("amsgrad") and not g.get("maximize")
                   for g in self.inner.param_groups)

    def publish_main_weights(self) -> None:
        """Make every model weight equal its (loaded or updated) main weight on every rank."""
        self.copy_main_to_model()

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
        return clip_grad_norm(self.model_params, max_norm, self.topology, grads_are_dp_sharded=self.is_dp_sharded,
                              shard_group=self.shard_group)

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply the gradients this optimizer reads (a loss scale's inverse) in place."""
        grads = [e.piece.grad for e in self.entries if e.piece.grad is not None and e.piece.grad.numel()]
        if grads:
            torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip the gradients to the global L2 norm ``max_norm`` (``inf``: no clipping) and
        take the step, without reading anything on the host: returns (norm, found_inf) as
        device scalars. ``skip`` (a device scalar, 1 = skip; the same on every rank) skips the
        update for another reason too (the trainer's: a non-finite loss).

        ``clip_grad_norm`` needs the norm on the host (``.item()``), and the host then waits
        for the whole backward before it can launch the update. Here the clip coefficient
        goes into the fused AdamW kernel as its ``grad_scale`` (each gradient divided by
        max(1, norm / max_norm) as it is read), and a non-finite norm (``found_inf`` = 1) makes
        the kernel leave weights, moments and step count as they were, as torch's GradScaler
        skips a step."""
        if not max_norm > 0:
            raise ParallelError(f"clip_and_step max_norm = {max_norm!r} must be > 0 (train.clip_grad; inf: no clipping)")
        norm = global_grad_norm(self.model_params, self.topology, self.is_dp_sharded, self.shard_group)
        found_inf = (~torch.isfinite(norm)).float()
        if skip is not None:
            found_inf = torch.maximum(found_inf, skip.to(found_inf.device, torch.float32))
        if self.fused:
            self.inner.grad_scale = (torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0)
                                     if math.isfinite(max_norm) else None)
            self.inner.found_inf = found_inf
        try:
            self.step()  # a rank with no parameters still joins the step's collectives
        finally:
            self.inner.grad_scale = self.inner.found_inf = None
        return norm, found_inf

    # ---- state -----------------------------------------------------------------------------
    def _layout(self) -> list[tuple[str, int, int]]:
        return [(e.name, e.first, e.piece.numel()) for e in self.entries]

    def state_dict(self) -> dict:
        """For an exact resume at the same layout; checkpoints use ``full_moments``/``state_pieces``."""
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
        for group in self.inner.param_groups:  # torch restores the saved "fused"; clip_and_step needs ours
            group["fused"] = True if self.fused else None

    def state_pieces(self) -> list[MomentPiece]:
        """The live AdamW moments of every piece this rank updates (see ``state_layout``);
        the state is created at step 0 if the optimizer has not stepped, so a checkpoint can
        be loaded into it in place. The step count is in ``common_state()``."""
        pieces = []
        for e in self.entries:
            state = ensure_adamw_state(self.inner, e.piece)
            moments = {m: state[m].view(-1) for m in MOMENTS}
            if e.model_view is not None:
                moments[MAIN_PARAM] = e.piece.detach().view(-1)
            pieces.append(MomentPiece(e.source, e.name, e.first, moments))
        return pieces

    def full_moments(self) -> Iterator[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
        """(parameter, {moment: tensor shaped like the parameter}) for every parameter; see
        ``state_layout``. Subclasses whose state is sharded override this."""
        for e in self.entries:
            state = ensure_adamw_state(self.inner, e.piece)
            moments = {m: state[m] for m in MOMENTS}
            if e.model_view is not None:
                moments[MAIN_PARAM] = e.piece.detach()
            yield e.source, moments

    def state_bytes(self) -> int:
        """Bytes of the state this rank holds: the moments, and fp32 main weights where the
        model's are 16-bit (a piece that is the weights' own storage is the model's, not counted)."""
        total = 0
        for e in self.entries:
            state = self.inner.state.get(e.piece, {})
            total += sum(state[m].numel() * state[m].element_size() for m in MOMENTS if m in state)
            if e.model_view is not None:
                total += e.piece.numel() * e.piece.element_size()
        return total

    def common_state(self) -> dict:
        """What every rank holds alike: the number of steps taken."""
        steps = {int(self.inner.state[e.piece]["step"]) for e in self.entries if self.inner.state[e.piece]}
        return {"step": steps.pop() if steps else 0}

    def load_common_state(self, common: dict) -> None:
        for e in self.entries:
            ensure_adamw_state(self.inner, e.piece)["step"].fill_(float(common["step"]))
