"""The LM head fused with the vocab-parallel cross-entropy: ``loss = CE(x Wᵀ, target)``
computed in chunks of tokens, so the fp32 logits, softmax and gradient never exist for the
whole micro-batch at once (the compute-dtype logits are kept whole only where that pays, see
``save_logits`` below).

Forward, per chunk of tokens: the logits GEMM in the compute dtype (autocast's, else the
inputs'), then in fp32 this rank's log-sum-exp over its real vocabulary columns and the
target's logit where this rank owns the target. After the last chunk two all-reduces over
the TP group (a max of the local log-sum-exps; a sum of their rescaled exponentials stacked
with the target logits) give every token's global log-sum-exp ``lse`` and its loss
``lse - logit[target]``: two collectives per micro-batch, whatever the number of chunks.
Columns at or past ``vocab_size`` (the padding to a multiple of 128·tp) take no part, as in
``vocab_parallel_cross_entropy``: they are outside the log-sum-exp and their probability
and gradient are exactly zero. A rank that holds only padding contributes nothing.

Backward: ``softmax = exp(logits - lse)``, ``dlogits = (softmax - onehot(target)) * grad_loss``
written in the compute dtype, per chunk, then ``dx = dlogits W`` and ``dW = dlogitsᵀ x`` (per
chunk and accumulated in fp32 when the logits are recomputed; once over all tokens when they
are kept, see below; into ``main_grad`` under gradient-accumulation fusion). Why not produce the
gradients in the forward pass and only scale them in backward: the output is a *per-token*
loss that the trainer weights per token (loss mask / token count / loss scale), so
``grad_loss`` is a vector known only in backward, and ``dW = Σ_t grad_loss_t · dlogits_tᵀ x_t``
does not factor it out. So backward needs the logits again, and there are two ways to have
them, chosen by ``save_logits`` (default: by dtype and size):

- keep them (the default for 16-bit compute up to ``MAX_SAVED_LOGITS_BYTES``, the fastest):
  one forward GEMM writes the whole ``[tokens, V/tp]`` buffer in the compute dtype; backward
  overwrites it, chunk by chunk, with ``dlogits`` and then runs ``dx`` and ``dW`` as one GEMM
  each over all tokens. Whole GEMMs, not one per chunk: fewer launches, and no per-chunk
  ``dx`` (``[c, V/tp] x [V/tp, h]``, few output tiles for a large GPU). Alone on one H100 the
  head's GEMMs then run at 763 TFLOP/s (``benchmarks/gpu/lm_head_bench.py``); the reference
  step's time did not change measurably. The kept logits are overwritten, so a second
  backward through the same graph (``retain_graph=True``) is refused by autograd's version
  check; pass ``save_logits=False`` for that. The unfused path keeps twice
  that buffer (its fp32 softmax) and passes through fp32 copies of the whole micro-batch
  besides: 0.8 GB kept for the reference model's micro-batch instead of 1.6 GB kept and
  3.3+ GB at its peak;
- recompute them (fp32 compute, where keeping them would cost what the unfused path keeps,
  or logits larger than the bound, e.g. a 256k vocabulary): one extra GEMM (about 2% of the
  reference model's FLOPs), and only ``x`` (which the plain linear saves too), the
  compute-dtype weight and one fp32 ``lse`` per token are kept.

Transient memory is one chunk: its logits in fp32 and (recomputing) its ``dlogits``; kept
logits take their ``dlogits`` in place (plus, where ``x`` is not in the compute dtype, its
gradient in the compute dtype before the cast).

The weight gradient leaves through autograd (it is returned from ``backward``), so a weight
tied to the embedding accumulates both gradients in one ``param.grad`` and the
post-accumulate-grad hooks of data parallelism fire as for any parameter.

Tensor and sequence parallelism are the column-parallel linear's: ``output_layer_cross_entropy``
enters the TP region with the same mapping as ``ColumnParallelLinear`` (identity forward /
all-reduce backward; under sequence parallelism all-gather forward / reduce-scatter backward),
so the partial ``dx`` of each rank's vocabulary slice is summed by autograd.

``compile=True`` runs the elementwise/reduction steps of a chunk (linear_cross_entropy_kernels.py)
through ``torch.compile`` (one reduction kernel forward, one pointwise kernel backward, writing
``dlogits`` in place where the logits are kept, instead of about five passes over the fp32
chunk each in eager mode); the GEMMs and collectives stay eager. Should compilation fail the
function says so once in the log and runs eagerly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.tensor_parallel import collectives as C
from mtl.parallel.tensor_parallel import mappings
from mtl.parallel.tensor_parallel.layers import ColumnParallelLinear
from mtl.parallel.tensor_parallel.linear_cross_entropy_kernels import CHUNK_KERNELS
from mtl.parallel.tensor_parallel.wgrad_fusion import accumulate_weight_grad, fused_main_grad

# Bound on one chunk's fp32 logits [chunk, V/tp]. 512 MiB is 2048 tokens of the reference
# model's 50304-word vocabulary, a GEMM of 2048 x 2048 x 50304: large enough to run at full
# speed, small against the ~3.3 GB the unchunked loss holds for 8192 tokens.
DEFAULT_CHUNK_BYTES = 512 * 2**20
# A forward hook with this attribute set to True only manages the layer's weights (ZeRO-3 frees
# them after the call, ``ddp/param_gather.py``) and reads the output only to hook its gradient:
# the fused path runs it on the per-token loss rather than falling back to whole logits.
WEIGHTS_ONLY_HOOK = "mtl_weights_only"
# Keep the logits for backward (16-bit compute only) when they take at most this much: the
# reference model's micro-batch (8192 tokens x 50304 words in bf16) is 0.8 GB.
MAX_SAVED_LOGITS_BYTES = 2 * 2**30


def chunk_rows(num_tokens: int, vocab_local: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk: equal chunks (a multiple of 64 rows) whose fp32 logits fit in
    ``chunk_bytes``, or every token in one chunk when they all fit."""
    if num_tokens == 0:
        return 1
    n_chunks = max(1, math.ceil(num_tokens * vocab_local * 4 / chunk_bytes))
    rows = math.ceil(num_tokens / n_chunks)
    if n_chunks > 1:
        rows = math.ceil(rows / 64) * 64
    return max(1, min(rows, num_tokens))


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, vocab_start, num_real, rows, compiled, save_logits, main_grad):
        # x [N, h] (the full sequence on every TP rank), weight [V/tp, h], target [N] int64.
        # save_logits: keep the logits for backward (True), recompute them there (False), or
        # decide here by the compute dtype and size (None, see the module docstring).
        cdtype = _compute_dtype(x, weight)
        device_type = x.device.type
        n, vocab_local = x.shape[0], weight.shape[0]
        if save_logits is None:
            save_logits = cdtype.itemsize <= 2 and n * vocab_local * cdtype.itemsize <= MAX_SAVED_LOGITS_BYTES
        saved = None
        with torch.autocast(device_type, enabled=False):
            x_c = x.to(cdtype)
            w_c = weight.to(cdtype)
            if save_logits and num_real > 0:
                saved = torch.empty((n, vocab_local), dtype=cdtype, device=x.device)
            not_mine = (target < vocab_start) | (target >= vocab_start + vocab_local)
            owned = ~not_mine
            target_local = (target - vocab_start).masked_fill(not_mine, 0)
            lse_local = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
            tgt = torch.zeros((n,), dtype=torch.float32, device=x.device)
            if saved is not None:
                torch.mm(x_c, w_c.t(), out=saved)  # one GEMM over all tokens (module docstring)
            if num_real > 0:
                for start in range(0, n, rows):
                    end = min(n, start + rows)
                    # [c, V/tp] in the compute dtype; the kernels below never write to it
                    logits = torch.mm(x_c[start:end], w_c.t()) if saved is None else saved[start:end]
                    lse_c, tgt_c = CHUNK_KERNELS.run(0, compiled, logits, target_local[start:end], owned[start:end],
                                                num_real)
                    lse_local[start:end] = lse_c
                    tgt[start:end] = tgt_c
            # Global log-sum-exp from the ranks' local ones: lse = M + log Σ_r exp(lse_r - M).
            row_max = C.all_reduce_max_(lse_local.clone(), group)
            sums = torch.stack([torch.exp(lse_local - row_max), tgt])  # [2, N]
            sums = C.all_reduce_sum_(sums, group)
            lse = row_max + torch.log(sums[0])
            loss = lse - sums[1]
        ctx.save_for_backward(x_c, w_c, lse, target_local, owned, saved)
        ctx.meta = (num_real, rows, compiled, cdtype, x.dtype, weight.dtype)
        ctx.main_grad = main_grad  # wgrad_fusion: the weight gradient GEMM(s) accumulate straight into it
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x_c, w_c, lse, target_local, owned, saved = ctx.saved_tensors
        num_real, rows, compiled, cdtype, x_dtype, w_dtype = ctx.meta
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, h = x_c.shape
        scale = grad_loss.reshape(-1).float()
        grad_x = None
        if need_x:  # a rank holding only padding sends zeros into the TP reduction
            grad_x = (torch.empty if num_real > 0 else torch.zeros)((n, h), dtype=x_dtype, device=x_c.device)
        grad_w = None
        if num_real > 0 and (need_x or need_w) and saved is not None:
            with torch.autocast(x_c.device.type, enabled=False):
                grad_w = _backward_from_saved(ctx, saved, x_c, w_c, lse, target_local, owned, scale, grad_x,
                                              need_x, need_w)
        elif num_real > 0 and (need_x or need_w):
            with torch.autocast(x_c.device.type, enabled=False):
                for start in range(0, n, rows):
                    end = min(n, start + rows)
                    xs = x_c[start:end]
                    logits = torch.mm(xs, w_c.t())
                    d = CHUNK_KERNELS.run(1, compiled, logits, lse[start:end], target_local[start:end],
                                     owned[start:end], scale[start:end], num_real, cdtype)
                    del logits
                    if need_x:
                        if x_dtype == cdtype:
                            torch.mm(d, w_c, out=grad_x[start:end])
                        else:
                            grad_x[start:end] = torch.mm(d, w_c)
                    if need_w and ctx.main_grad is not None:
                        accumulate_weight_grad(ctx.main_grad, d, xs)
                    elif need_w:
                        if grad_w is None:
                            grad_w = torch.mm(d.t(), xs).float()
                        elif cdtype == torch.float32:
                            grad_w.addmm_(d.t(), xs)
                        else:
                            grad_w += torch.mm(d.t(), xs)
        if need_w and ctx.main_grad is not None:
            grad_w = torch.empty_like(w_c, dtype=w_dtype)  # the DataParallel hook drops it (wgrad_fusion)
        elif need_w:
            if grad_w is None:  # this rank holds only padding: its rows get no gradient
                grad_w = torch.zeros(w_c.shape, dtype=torch.float32, device=w_c.device)
            grad_w = grad_w.to(w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def _backward_from_saved(ctx, saved, x_c, w_c, lse, target_local, owned, scale, grad_x, need_x, need_w):
    """Backward over the kept logits: ``dlogits`` overwrites them chunk by chunk (the
    elementwise kernels' fp32 transient stays one chunk), then ``dx`` and ``dW`` are one GEMM
    each over all tokens. Returns the weight gradient autograd takes (None where ``main_grad``
    took it or none is needed)."""
    num_real, rows, compiled, cdtype, x_dtype, w_dtype = ctx.meta
    n = saved.shape[0]
    for start in range(0, n, rows):
        end = min(n, start + rows)
        chunk = saved[start:end]
        CHUNK_KERNELS.run(2, compiled, chunk, chunk, lse[start:end], target_local[start:end], owned[start:end],
                     scale[start:end], num_real)
    dlogits = saved  # [N, V/tp] in the compute dtype
    if need_x:
        if x_dtype == cdtype:
            torch.mm(dlogits, w_c, out=grad_x)
        else:
            grad_x.copy_(torch.mm(dlogits, w_c))
    if need_w and ctx.main_grad is not None:
        accumulate_weight_grad(ctx.main_grad, dlogits, x_c)
        return None
    if not need_w:
        return None
    if w_dtype == cdtype:
        return torch.mm(dlogits.t(), x_c)
    # 16-bit compute over fp32 weights (autocast): an fp32 result, not a 16-bit one rounded
    grad_w = torch.zeros(w_c.shape, dtype=torch.float32, device=w_c.device)
    accumulate_weight_grad(grad_w, dlogits, x_c)
    return grad_w


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group=None,
    tp_rank: int = 0,
    vocab_size: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    compile: bool = False,
    save_logits: bool | None = None,
) -> torch.Tensor:
    """Per-token loss (fp32, shaped like ``target``) of ``hidden @ weight.T`` against ``target``.

    ``hidden`` is ``[..., h]``, already in the TP region (the whole sequence on every TP rank,
    see ``output_layer_cross_entropy`` for the mapping in), ``weight`` this rank's
    ``[V/tp, h]`` rows of the (padded) output layer, ``target`` int64 ``[...]`` in
    ``[0, vocab_size)``. ``vocab_size`` is the true vocabulary (None: no padding); ``group``
    the TP group (None: one rank). ``save_logits``: keep the compute-dtype logits for backward
    (True) or recompute them there (False); None decides (16-bit compute and at most
    ``MAX_SAVED_LOGITS_BYTES``: keep)."""
    if target.shape != hidden.shape[:-1]:
        raise ParallelError(
            f"linear_cross_entropy: target shape {tuple(target.shape)} must equal the hidden states' "
            f"leading shape {tuple(hidden.shape[:-1])} (hidden {tuple(hidden.shape)})"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ParallelError(
            f"linear_cross_entropy: weight {tuple(weight.shape)} must be [V/tp, {hidden.shape[-1]}]"
        )
    vocab_local = weight.shape[0]
    vocab_start = tp_rank * vocab_local
    num_real = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - vocab_start))
    x = hidden.reshape(-1, hidden.shape[-1])
    rows = chunk_rows(x.shape[0], vocab_local, chunk_bytes)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        save_logits = False  # no backward will read them
    loss = _LinearCrossEntropy.apply(x, weight, target.reshape(-1), group, vocab_start, num_real, rows, compile,
                                     save_logits, fused_main_grad(weight))
    return loss.view(target.shape)


def supports_fused_cross_entropy(layer: nn.Module) -> bool:
    """Whether ``output_layer_cross_entropy`` may replace ``layer(x)`` + the vocab-parallel loss.

    A layer decides by a ``fused_cross_entropy`` attribute when it has one (True: it is
    ``y = x Wᵀ`` over ``layer.weight`` with ColumnParallelLinear's TP/SP contract). Otherwise
    yes only for mtl.parallel's own ``ColumnParallelLinear`` with its own ``forward`` and
    ``local_linear`` (so not a quantized subclass such as mtl-quant's FP8 layer, nor another
    backend's module, e.g. Transformer Engine's), without bias or ``gather_output``, and
    without forward hooks that expect the logits (forward *pre*-hooks are run, and so are the
    hooks flagged ``WEIGHTS_ONLY_HOOK``, on the loss)."""
    flag = getattr(layer, "fused_cross_entropy", None)
    if flag is not None:
        return bool(flag)
    return (
        isinstance(layer, ColumnParallelLinear)
        and type(layer).forward is ColumnParallelLinear.forward
        and type(layer).local_linear is ColumnParallelLinear.local_linear
        and layer.bias is None
        and not layer.gather_output
        and all(getattr(hook, WEIGHTS_ONLY_HOOK, False) for hook in layer._forward_hooks.values())
        and not nn.modules.module._global_forward_hooks
    )


def _run_forward_pre_hooks(module: nn.Module, args: tuple) -> tuple:
    """What ``module(*args)`` runs before ``forward``: the global and the module's forward
    pre-hooks (e.g. data parallelism waiting for this module's parameter all-gather)."""
    hooks = [*nn.modules.module._global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()]
    for hook_id, hook in hooks:
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, {})
            if result is not None:
                args = result[0]
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args


def _run_weights_only_hooks(module: nn.Module, args: tuple, loss: torch.Tensor) -> None:
    """The module's forward hooks flagged ``WEIGHTS_ONLY_HOOK`` (the only ones a fused layer
    has), given the loss for the logits they never read."""
    for hook_id, hook in module._forward_hooks.items():
        if hook_id in module._forward_hooks_with_kwargs:
            hook(module, args, {}, loss)
        else:
            hook(module, args, loss)


def output_layer_cross_entropy(
    layer: nn.Module,
    hidden: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    compile: bool = False,
    save_logits: bool | None = None,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(layer(hidden), target)`` without the logits: per-token
    fp32 loss ``[s, b]`` for ``hidden`` ``[s, b, h]`` (``[s/tp, b, h]`` under the layer's
    sequence parallelism) and ``target`` ``[s, b]``. ``layer`` must pass
    ``supports_fused_cross_entropy``."""
    args = _run_forward_pre_hooks(layer, (hidden,))
    tp, tp_rank, group = getattr(layer, "tp", 1), getattr(layer, "tp_rank", 0), getattr(layer, "tp_group", None)
    if getattr(layer, "sequence_parallel", False):
        hidden = mappings.gather_from_sequence_parallel(args[0], group)  # [s/tp, b, h] -> [s, b, h]
    else:
        hidden = mappings.copy_to_tensor_parallel(args[0], group)
    loss = linear_cross_entropy(
        hidden, layer.weight, target, group=group if tp > 1 else None, tp_rank=tp_rank,
        vocab_size=vocab_size, chunk_bytes=chunk_bytes, compile=compile, save_logits=save_logits,
    )
    _run_weights_only_hooks(layer, args, loss)
    return loss
