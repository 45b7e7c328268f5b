"""Autoregressive sampling with a KV cache (single process) from any family's model: it uses
only ``LanguageModel``'s forward (logits without labels, ``inference_context``) and ``config``."""

from __future__ import annotations

import torch

from mtl.core.errors import ConfigError
from mtl.core.model_protocol import LanguageModel
from mtl.models.gpt.inference_context import InferenceContext


@torch.no_grad()
def generate(
    model: LanguageModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    eod: int | None = None,
    seed: int = 0,
    *,
    use_cache: bool = True,
) -> list[int]:
    """The tokens sampled after ``prompt_ids`` (the prompt itself is not repeated), stopping
    after ``max_new_tokens`` or before ``eod``. ``temperature == 0`` is greedy; ``top_k > 0``
    samples among the k most likely tokens. ``use_cache=False`` recomputes the whole sequence
    each step (the reference the cache is tested against)."""
    if not prompt_ids:
        raise ConfigError("generate needs a non-empty prompt (prompt_ids = [])")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ConfigError(
            f"generate: temperature = {temperature}, top_k = {top_k}, max_new_tokens = {max_new_tokens} "
            "must not be negative"
        )
    m = model.config.model
    total = len(prompt_ids) + max_new_tokens
    if m.position_embedding == "learned" and total > m.max_position_embeddings:
        raise ConfigError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"model.max_position_embeddings = {m.max_position_embeddings}; shorten the request"
        )
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = InferenceContext(max_batch_size=1, max_sequence_length=total) if use_cache else None
    tokens = list(prompt_ids)
    pending = tokens  # the tokens the model has not seen yet
    new_tokens: list[int] = []
    try:
        for _ in range(max_new_tokens):
            step_input = pending if use_cache else tokens
            ids = torch.tensor([step_input], dtype=torch.long, device=device)  # [1, s]
            logits = model(ids, inference_context=context)[0, -1]  # [V_padded]
            next_token = _sample(logits[: m.vocab_size].float(), temperature, top_k, generator)  # true vocabulary only
            if eod is not None and next_token == eod:
                break
            new_tokens.append(next_token)
            tokens.append(next_token)
            pending = [next_token]
    finally:
        model.train(was_training)
    return new_tokens


def _sample(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id from logits [V] (padding rows already dropped)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
