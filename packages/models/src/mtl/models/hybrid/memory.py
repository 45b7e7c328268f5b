"""The hybrid family's activation memory for ``--dry-run``: what each layer keeps for backward, one
micro-batch on one rank, by the layer's symbol.

A Mamba-2 layer is counted tensor by tensor as autograd saves them in mtl's mixer with the
PyTorch chunked scan (``mamba/ssd.py``; listed by walking the backward graph's ``_saved_*``
tensors, and a test holds the count within 5% of the bytes measured on CPU). Per token, with
``a`` the activation bytes (2 under bf16/fp16, 4 in fp32), 4 for the fp32 the scan and the gated
norm compute in, ``I`` the inner width, ``H`` heads, ``G`` groups, ``N`` the state, ``P`` the head
width, ``L`` the chunk and ``c`` the chunks of the sequence ``s``:

- the norm: its fp32 input copy (4h), its output = the in-projection's input (a*h), rstd (4);
- the convolution's padded input and its output (2 * a * (I + 2GN), the padding k - 1 per sequence);
- the gated norm (y, y*silu(z), z, silu(z), the normalised values: 5 * 4 * I) and its rstd (4G);
  x in fp32 (4I, twice under 16-bit: two casts); the out-projection's input (a*I);
- the scan's einsum operands: x*dt three times (3aI), B and C four times (4aHN) and B*decay (4HN);
  the chunk scores (2aHL) and their decay (4HL); two decays (2 * 4H), all at the length padded to
  whole chunks; the chunk states (a*H*P*N*(2c + 1)/s); dt and softplus's input (2 * 4H); the
  chunk-to-chunk decay ((4 + a) * H * (c+1)^2 / s, 4 alone in fp32, where the cast is the same tensor);
- and per layer, not per token, the scan's four boolean masks (2L^2 + 2(c+1)^2 bytes).

With mamba-ssm's Triton scan on a GPU (``mamba/dispatch.py``) the scan keeps fewer tensors (its
inputs, output and chunk cumulative sums): this count is the PyTorch scan's, an upper bound there.
Under TP the mixer's widths are this rank's heads; under CP each rank scans the whole sequence
for 1/cp of its heads, the same bytes as its 1/cp of the tokens for all of them. Attention, MLP
and MoE layers count as gpt counts its layers (``mtl.models.gpt.flops``), one norm each.
"""

from __future__ import annotations

import math

from mtl.core.config import RunConfig
from mtl.core.config_hybrid import layer_symbols
from mtl.models.gpt.flops import attention_bytes_per_unit, layer_activation_bytes, mlp_bytes_per_unit


def mamba_bytes_per_token(m, activation_bytes: int) -> float:
    """Bytes one Mamba-2 mixer keeps per token of the whole sequence at tp = cp = 1, its norm's
    output (the in-projection's input) included; ``m``: the resolved model section."""
    a, f = activation_bytes, 4
    heads, groups, state, head_dim = m.mamba_num_heads, m.mamba_num_groups, m.mamba_state_dim, m.mamba_head_dim
    inner, s, chunk = heads * head_dim, m.seq_length, m.mamba_chunk_size
    chunks = math.ceil(s / chunk)
    conv = (inner + 2 * groups * state) * (2 + (m.mamba_conv_kernel - 1) / s) * a
    gated_norm = 5 * f * inner + f * groups
    x_copies = (1 if a == f else 2) * f * inner  # x.float() is x itself in fp32, a copy per use in 16-bit
    padded = chunks * chunk / s  # the scan pads the sequence to whole chunks
    scan = ((3 * a * inner + 4 * a * heads * state + f * heads * state + 2 * f * heads) * padded
            + (2 * a + f) * heads * chunk * padded  # the chunks' [L, L] scores
            + a * heads * head_dim * state * (2 * chunks + 1) / s
            + 2 * f * heads  # dt and softplus's input
            + (f + (a if a != f else 0)) * heads * (chunks + 1) ** 2 / s)
    return a * m.hidden_size + conv + gated_norm + x_copies + scan + a * inner


def mamba_layer_bytes(cfg: RunConfig) -> float:
    """One Mamba-2 layer (norm + mixer) for one micro-batch on one rank."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    a = 4 if t.precision == "fp32" else 2
    tokens = t.micro_batch_size * m.seq_length // p.cp  # this rank's; its heads' share is the same bytes
    if t.recompute == "full":
        return 2 * tokens * m.hidden_size / p.tp  # the layer's input alone, as gpt counts it
    norm_input = (4 * m.hidden_size + 4) * tokens  # the fp32 copy the norm computes in, and its rstd
    if p.sequence_parallel:
        norm_input /= p.tp
    chunks = math.ceil(m.seq_length / m.mamba_chunk_size)
    masks = 2 * m.mamba_chunk_size ** 2 + 2 * (chunks + 1) ** 2
    # the in-projection's input (the norm's output) is whole on every TP rank without SP; the rest
    # of the mixer is this rank's heads
    mixer = tokens * (mamba_bytes_per_token(m, a) - a * m.hidden_size) / p.tp
    in_proj_input = tokens * a * m.hidden_size / (p.tp if p.sequence_parallel else 1)
    return norm_input + in_proj_input + mixer + masks


def activation_bytes_per_layer(cfg: RunConfig) -> list[float]:
    """Each layer's activation bytes for one micro-batch on one rank, in layer order."""
    m = cfg.model
    assert cfg.resolved, "resolve the config first"
    per_symbol = {
        "M": mamba_layer_bytes(cfg),
        "*": layer_activation_bytes(cfg, norms=1, split=attention_bytes_per_unit(m)),
        "-": layer_activation_bytes(cfg, norms=1, split=mlp_bytes_per_unit(m, m.ffn_hidden_size)),
    }
    if m.num_experts:
        per_symbol["E"] = layer_activation_bytes(cfg, norms=1, split=moe_bytes_per_unit(m))
    return [per_symbol[symbol] for symbol in layer_symbols(m.hybrid_pattern)]


def moe_bytes_per_unit(m) -> float:
    """An MoE layer's bytes per token and hidden unit (16-bit values 2), as mtl's ``MoELayer``
    keeps them: the router's fp32 copy of its input (4) and its fp32 scores and weights (4 bytes
    each per expert); per chosen expert the token gathered to it (2), its MLP, and its output in
    fp32 before and after the routing weight (8); the shared expert's MLP."""
    experts = m.moe_top_k * (2 + mlp_bytes_per_unit(m, m.moe_ffn_hidden_size) + 8)
    shared = mlp_bytes_per_unit(m, m.moe_shared_expert_ffn_hidden_size) if m.moe_shared_expert_ffn_hidden_size else 0
    return 4 + experts + shared + 2 * 4 * m.num_experts / m.hidden_size
