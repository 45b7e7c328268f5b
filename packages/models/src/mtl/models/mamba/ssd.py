"""The SSD (state-space duality) scan of Mamba-2, in PyTorch: the chunked algorithm, the naive
recurrence it must equal, and the one-step update of decoding.

Per head ``h`` the state ``S`` is ``[p, n]`` and each position ``t`` does
``S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t ⊗ B_t`` and emits ``y_t = S_t C_t``; ``B`` and ``C``
are shared by the ``h / g`` heads of a group. Layouts are mamba-ssm's (so its Triton kernel
plugs in unchanged, see ``dispatch.py``):

- ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]`` (already positive: softplus(dt + dt_bias)),
  ``A`` ``[h]`` (negative: -exp(A_log)), ``B`` and ``C`` ``[b, l, g, n]``,
  ``initial_state`` ``[b, h, p, n]`` or None (zeros); the skip ``D * x`` is the mixer's.

The chunked form splits the sequence into chunks of ``chunk_size``: inside a chunk the output is
a masked (decaying) attention-like matmul; across chunks only the ``[h, p, n]`` states pass,
one short recurrence over the chunk ends. It is the CPU path and the reference for a GPU kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``a [..., T]`` -> ``[..., T, T]`` with ``[i, j] = a[j+1] + ... + a[i]`` for ``i >= j`` and
    -inf above the diagonal, so ``exp`` of it is the decay from position j to i (0 for j > i).
    Built by a masked cumulative sum, not a difference of cumsums, which loses precision."""
    length = a.shape[-1]
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    spread = a.unsqueeze(-1).expand(*a.shape, length).masked_fill(~strictly_lower, 0.0)  # [..., i, j] = a[i]
    sums = torch.cumsum(spread, dim=-2)
    lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(0)
    return sums.masked_fill(~lower, float("-inf"))


def _heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[b, l, g, n]`` -> ``[b, l, h, n]``: each group's rows shared by its ``h / g`` heads."""
    return t.repeat_interleave(num_heads // t.shape[2], dim=2)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan: ``(y [b, l, h, p], final_state [b, h, p, n])``."""
    batch, length, heads, head_dim = x.shape
    B, C = _heads_of_groups(B, heads), _heads_of_groups(C, heads)  # [b, l, h, n]
    x_dt = x * dt.unsqueeze(-1)
    log_decay = dt * A  # [b, l, h], <= 0
    pad = (-length) % chunk_size
    if pad:  # zero steps: decay exp(0) = 1 and no input, so states and outputs are untouched
        x_dt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x_dt, B, C))
        log_decay = F.pad(log_decay, (0, 0, 0, pad))
    chunks = (length + pad) // chunk_size
    x_dt, B, C = (t.reshape(batch, chunks, chunk_size, heads, -1) for t in (x_dt, B, C))  # [b, c, L, h, *]
    log_decay = log_decay.reshape(batch, chunks, chunk_size, heads).permute(0, 3, 1, 2)  # [b, h, c, L]
    cumulative = torch.cumsum(log_decay, dim=-1)  # [b, h, c, L]

    # 1. inside each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(decay j -> i) x_j dt_j
    within = torch.exp(segment_sums(log_decay))  # [b, h, c, L, L]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * within
    y_within = torch.einsum("bhcls,bcshp->bclhp", scores, x_dt)

    # 2. each chunk's own contribution to the state at its end: [b, c, h, p, n]
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [b, h, c, L]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x_dt)

    # 3. the states entering each chunk: a recurrence over the chunk ends, [b, c + 1, h, p, n]
    if initial_state is None:
        initial_state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    chunk_states = torch.cat([initial_state.unsqueeze(1).to(chunk_states.dtype), chunk_states], dim=1)
    across = torch.exp(segment_sums(F.pad(cumulative[..., -1], (1, 0))))  # [b, h, c + 1, c + 1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", across, chunk_states)
    entering, final_state = entering[:, :-1], entering[:, -1]

    # 4. what the entering state gives each position of its chunk
    from_start = torch.exp(cumulative)  # [b, h, c, L]
    y_carried = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, from_start)
    y = (y_within + y_carried).reshape(batch, chunks * chunk_size, heads, head_dim)[:, :length]
    return y, final_state


def ssd_naive(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one position at a time (the definition; tests compare against it)."""
    state = initial_state
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    outputs = []
    for t in range(x.shape[1]):
        y_t, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state)
        outputs.append(y_t)
    return torch.stack(outputs, dim=1), state


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: ``x [b, h, p]``, ``dt [b, h]``, ``B``/``C`` ``[b, g, n]``, ``state [b, h, p, n]``
    -> ``(y [b, h, p], new state)``; decoding's cost per token, independent of the position."""
    heads = x.shape[1]
    B, C = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (B, C))  # [b, h, n]
    decay = torch.exp(dt * A)[..., None, None]  # [b, h, 1, 1]
    state = decay * state + (dt.unsqueeze(-1) * x).unsqueeze(-1) * B.unsqueeze(-2)
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    return y, state
