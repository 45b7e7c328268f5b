"""AdamW and the main -> model weight copy in one Triton pass per tensor (CUDA).

With bf16/fp16 weights and fp32 main weights, torch's fused AdamW reads and writes the
main weight and both moments, and a separate copy then reads the main weight again to
write the model weight. This kernel does both in one pass: it updates the fp32 main weight
and moments and writes the new weight, rounded to nearest-even, into the model's storage.

The arithmetic follows the CUDA source of torch's fused AdamW (``_fused_adamw_``) as of this
writing: the terms it computes in double (the decoupled weight decay, both moment updates,
the step size and ``+ eps``) are computed in fp64 here too, the rest in fp32 with IEEE-rounded
division and square root. torch 2.11's kernel rounds some of those terms elsewhere: on an H100
the weights agree with it within a few ulps (2 after four steps), the moments within a
millionth of their largest value (tests/optimizer/test_triton_adamw.py). The optimizer state stays torch's own
(``inner.state[piece]``: ``exp_avg``, ``exp_avg_sq``, a float32 ``step`` on the device), so
state dicts and checkpoints do not change. ``grad_scale``/``found_inf`` behave as in torch:
gradients are divided by ``grad_scale``; ``found_inf`` == 1 leaves weights, moments and step
counts as they were. Unlike torch, the unscaled gradient is not written back (nothing reads
it after the step, and it would cost another pass over the gradients).

Without triton installed (CPU installs) this module imports and ``AVAILABLE`` is False. Under
``TRITON_INTERPRET=1`` the kernel runs in Triton's interpreter on CPU tensors (tests).
"""

import contextlib
import os
import struct

import torch

from mtl.parallel.optimizer.state_layout import ensure_adamw_state

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = tl = None

AVAILABLE = triton is not None
# The interpreter runs the kernel on CPU tensors (TRITON_INTERPRET is read when the kernel is defined).
INTERPRETED = AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") == "1"
MODEL_DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 1024


def supports(entries) -> bool:
    """True when every entry can take the one-pass update: fp32 main weights of contiguous
    bf16/fp16 model storage on CUDA (or on CPU under the interpreter)."""
    if not AVAILABLE or not entries:
        return False
    device_type = "cpu" if INTERPRETED else "cuda"
    for e in entries:
        mv, piece = e.model_view, e.piece
        if (mv is None or mv.dtype not in MODEL_DTYPES or not mv.is_contiguous()
                or piece.dtype != torch.float32 or not piece.is_contiguous()
                or mv.numel() != piece.numel() or piece.device.type != device_type or mv.device != piece.device):
            return False
    return True


def _bits(x: float) -> int:
    """A Python float's IEEE double bits: Triton passes float arguments as fp32 (and the
    interpreter ignores an fp64 annotation), so the doubles torch uses travel as int64."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


if AVAILABLE:

    @triton.jit
    def _f64(bits):
        return bits.to(tl.int64).to(tl.float64, bitcast=True)

    # Hyperparameters are not specialized on their value: lr changes every step and must not recompile.
    @triton.jit(do_not_specialize=["lr_bits", "lr_wd_bits", "beta1_bits", "one_minus_beta1_bits",
                                   "beta2_bits", "one_minus_beta2_bits", "eps_bits"])
    def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, coef_ptr,
                      grad_scale_ptr, found_inf_ptr, n,
                      lr_bits: tl.int64, lr_wd_bits: tl.int64, beta1_bits: tl.int64, one_minus_beta1_bits: tl.int64,
                      beta2_bits: tl.int64, one_minus_beta2_bits: tl.int64, eps_bits: tl.int64,
                      HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
                      MODEL_BF16: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: pieces may exceed 2**31
        if HAS_FOUND_INF:  # a skipped step: with no element in range, loads and stores touch no memory
            n = tl.where(tl.load(found_inf_ptr) == 1.0, 0, n)
        mask = offs < n
        p = tl.load(param_ptr + offs, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0)
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
        if HAS_GRAD_SCALE:
            # torch divides by the scale in double and rounds to fp32: the same as an IEEE fp32 division.
            g = tl.math.div_rn(g, tl.load(grad_scale_ptr))
        if HAS_WEIGHT_DECAY:  # torch: param -= lr * weight_decay * param, in double
            p64 = p.to(tl.float64)
            p = (p64 - _f64(lr_wd_bits) * p64).to(tl.float32)
        g64 = g.to(tl.float64)
        m = (_f64(beta1_bits) * m.to(tl.float64) + _f64(one_minus_beta1_bits) * g64).to(tl.float32)
        v = (_f64(beta2_bits) * v.to(tl.float64) + _f64(one_minus_beta2_bits) * g64 * g64).to(tl.float32)
        # This tensor's fp32 bias corrections (1 - beta1**step, sqrt(1 - beta2**step)), from step_coefficients.
        bias_correction1 = tl.load(coef_ptr)
        bias_correction2_sqrt = tl.load(coef_ptr + 1)
        step_size = (_f64(lr_bits) / bias_correction1.to(tl.float64)).to(tl.float32)
        denom = (tl.math.div_rn(tl.math.sqrt_rn(v), bias_correction2_sqrt).to(tl.float64) + _f64(eps_bits)).to(tl.float32)
        p = p - tl.math.div_rn(step_size * m, denom)
        tl.store(param_ptr + offs, p, mask=mask)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if MODEL_BF16:
            # Round to nearest even by hand, as torch's fp32 -> bf16 copy (NaN -> 0x7FC0): the
            # interpreter's own bf16 cast truncates.
            u = p.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            u = tl.where(p != p, 0x7FC0, u)
            tl.store(model_ptr + offs, u.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(model_ptr + offs, p.to(model_ptr.dtype.element_ty), mask=mask)


def step_coefficients(steps: list[torch.Tensor], beta1: float, beta2: float) -> torch.Tensor:
    """(len(steps), 2) fp32: 1 - beta1**step and sqrt(1 - beta2**step) per tensor, computed on
    the device in double and rounded to fp32, as torch's fused kernel does (same ``pow``)."""
    s = torch.stack(steps).double()
    return torch.stack([1 - torch.pow(beta1, s), torch.sqrt(1 - torch.pow(beta2, s))], dim=1).float()


@torch.no_grad()
def adamw_step(optimizer: torch.optim.AdamW, entries, grad_scale: torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step of ``optimizer``'s groups over ``entries`` (``StateEntry``: fp32 ``piece``
    with its ``.grad``, ``model_view`` the model storage written with the result). Entries
    without a gradient are skipped, as torch skips them. Reads nothing on the host."""
    by_piece = {e.piece: e for e in entries}
    for group in optimizer.param_groups:
        todo = [by_piece[p] for p in group["params"] if p.grad is not None]
        if not todo:
            continue
        states = [ensure_adamw_state(optimizer, e.piece) for e in todo]
        for e, st in zip(todo, states):  # the kernel indexes every tensor as flat, dense fp32
            for what, t in (("gradient", e.piece.grad), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != e.piece.shape:
                    raise ValueError(f"{e.name}: the one-pass AdamW needs a contiguous fp32 {what} shaped like "
                                     f"its main weight, got {t.dtype} {tuple(t.shape)}")
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)  # as torch: count first, subtract found_inf afterwards
        beta1, beta2 = group["betas"]
        coefs = step_coefficients(steps, beta1, beta2)
        lr, wd = group["lr"], group["weight_decay"]
        device = todo[0].piece.device
        flags = dict(HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                     HAS_WEIGHT_DECAY=wd != 0, BLOCK=BLOCK)
        scalars = (_bits(lr), _bits(lr * wd), _bits(beta1), _bits(1 - beta1), _bits(beta2), _bits(1 - beta2),
                   _bits(group["eps"]))
        gs = grad_scale.to(device, torch.float32) if grad_scale is not None else None
        fi = found_inf.to(device, torch.float32) if found_inf is not None else None
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for k, (e, st) in enumerate(zip(todo, states)):
                n = e.piece.numel()
                _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                    e.piece, e.piece.grad, st["exp_avg"], st["exp_avg_sq"], e.model_view, coefs[k],
                    gs, fi, n, *scalars, MODEL_BF16=e.model_view.dtype == torch.bfloat16, **flags)
        if fi is not None:
            torch._foreach_sub_(steps, [fi] * len(steps))
