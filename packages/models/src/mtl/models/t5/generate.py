"""Greedy encoder-decoder generation: the encoder runs once; the decoder takes one token per step,
its self-attention keys and values cached and the cross-attention's projected once
(``EncoderDecoderContext``); ``use_cache=False`` recomputes the decoder over all tokens."""

from __future__ import annotations

import torch

from mtl.models.t5.model import EncoderDecoderContext
from mtl.parallel.tensor_parallel import gather_from_tensor_parallel


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None, *,
                    max_new_tokens: int, decoder_start_token_id: int = 0, eos_token_id: int | None = 1,
                    use_cache: bool = True, temperature: float = 0.0, top_k: int = 0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """input_ids [b, s_enc] -> decoder tokens [b, 1 + n] (the start token first), as HF's
    ``generate(do_sample=False, num_beams=1)`` at ``temperature = 0``: a finished row continues
    with the pad id 0. ``temperature > 0`` samples (from the ``top_k`` likeliest when not 0)."""
    encoder_output = model.encode(input_ids, padding_mask)  # [s_enc, b, h], computed once
    tokens = torch.full((input_ids.shape[0], 1), decoder_start_token_id, dtype=torch.long, device=input_ids.device)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    vocab = model.shape.vocab_size
    context = EncoderDecoderContext(input_ids.shape[0], max_new_tokens + 1) if use_cache else None
    for _ in range(max_new_tokens):
        step_tokens = tokens[:, -1:] if use_cache else tokens  # with the cache: the newest token only
        logits = model(input_ids, decoder_input_ids=step_tokens, padding_mask=padding_mask,
                       encoder_output=encoder_output, inference_context=context)[:, -1]
        if model.topology is not None and model.topology.tp > 1:
            logits = gather_from_tensor_parallel(logits, model.topology.tp_group)  # [b, V/tp] -> [b, V]
        next_token = _pick(logits[:, :vocab].float(), temperature, top_k, generator)
        next_token = torch.where(finished, torch.zeros_like(next_token), next_token)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if eos_token_id is not None:
            finished |= next_token == eos_token_id
            if bool(finished.all()):
                break
    return tokens


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator) -> torch.Tensor:
    """[b, V] -> [b] token ids: the argmax, or a sample at ``temperature`` from the top ``top_k``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def t5_generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                eod: int | None = None, seed: int = 0) -> list[int]:
    """The t5 family's ``generate`` (``mtl generate``): the prompt is the encoder's input and the
    answer the decoder's tokens after the start token, up to and without ``eod``."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = greedy_generate(model, torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                             eos_token_id=eod, temperature=temperature, top_k=top_k, generator=generator)
    answer = tokens[0, 1:].tolist()
    return answer[:answer.index(eod)] if eod in answer else answer
