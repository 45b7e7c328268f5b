"""Text in, text out: tokenizer + checkpointed model + mtl.models' KV-cache generation."""

from __future__ import annotations

import torch

from mtl.models.generate import generate
from mtl.train.inference import load_for_inference


def generate_text(checkpoint: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 1.0,
                  top_k: int = 0, seed: int = 0, device: str = "cpu") -> str:
    model, tokenizer, _ = load_for_inference(checkpoint, device=torch.device(device))
    prompt_ids = tokenizer.encode(prompt)
    new_ids = generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                       eod=tokenizer.eod, seed=seed)
    return prompt + tokenizer.decode(new_ids)
