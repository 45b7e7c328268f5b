"""The plain-PyTorch peer of bench_speed.py: what a user writes in an afternoon.

A Llama-style decoder (RMSNorm via F.rms_norm, RoPE, SDPA causal attention with grouped
K/V heads, SwiGLU MLP, untied LM head), fp32 parameters under bf16 autocast, fused AdamW,
gradient clipping at 1.0, gradient accumulation over micro-batches, ``torch.compile`` on each
block when asked. Its shapes come from a resolved mtl ``RunConfig`` so it is the same model
as mtl's run of that config, and Megatron's FLOP formula counts the same work for both (its
head has all ``padded_vocab_size`` rows, as the formula counts; the reference model's 50304
words need no padding). Nothing from mtl runs in the step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]  # [1, s, 1, d]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # rotate in the activations' dtype
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = F.rms_norm(x, (h,), self.attn_norm, self.eps)
        q, k, v = self.qkv(y).view(b, s, -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(F.rms_norm(x, (h,), self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PeerLlama(nn.Module):
    def __init__(self, cfg, device):
        """``cfg``: a resolved mtl RunConfig (only its model section's numbers are read)."""
        super().__init__()
        m = cfg.model
        self.vocab = m.padded_vocab_size
        self.embed = nn.Embedding(self.vocab, m.hidden_size)
        self.blocks = nn.ModuleList(
            Block(m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.ffn_hidden_size, m.norm_eps)
            for _ in range(m.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(m.hidden_size))
        self.head = nn.Linear(m.hidden_size, self.vocab, bias=False)
        self.eps = m.norm_eps
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=m.init_std)
        self.to(device)
        self.cos, self.sin = rope_tables(m.seq_length, m.head_dim, m.rope_theta, device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # [b, s, h]
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(F.rms_norm(x, (x.shape[-1],), self.norm, self.eps))
        return F.cross_entropy(logits.float().view(-1, self.vocab), labels.reshape(-1))


class PeerTrainer:
    """One iteration = ``num_micro_batches`` forward/backward passes, clip, AdamW step."""

    def __init__(self, cfg, device: torch.device, compile_blocks: bool):
        t = cfg.train
        torch.manual_seed(t.seed)
        self.model = PeerLlama(cfg, device)
        if compile_blocks:
            for block in self.model.blocks:
                block.compile()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                           eps=t.adam_eps, weight_decay=t.weight_decay, fused=True)
        self.n_micro, self.clip = t.num_micro_batches, t.clip_grad
        self.autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")
        g = torch.Generator(device="cpu").manual_seed(t.seed)
        data = torch.randint(0, cfg.model.vocab_size, (self.n_micro, t.micro_batch_size, cfg.model.seq_length + 1),
                             generator=g)
        self.data = data.to(device)

    def step(self) -> float:
        total = torch.zeros((), device=self.data.device)
        for i in range(self.n_micro):
            tokens, labels = self.data[i, :, :-1], self.data[i, :, 1:]
            with torch.autocast(**self.autocast):
                loss = self.model(tokens, labels) / self.n_micro
            loss.backward()
            total += loss.detach()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()  # one host sync per iteration, as a loop that logs its loss has
