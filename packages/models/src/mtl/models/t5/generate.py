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
                    use_cache: bool = True) -> torch.Tensor:
    """input_ids [b, s_enc] -> decoder tokens [b, 1 + n] (the start token first), as HF's
    ``generate(do_sample=False, num_beams=1)``: a finished row continues with the pad id 0."""
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
        next_token = logits[:, :vocab].argmax(dim=-1)
        next_token = torch.where(finished, torch.zeros_like(next_token), next_token)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if eos_token_id is not None:
            finished |= next_token == eos_token_id
            if bool(finished.all()):
                break
    return tokens
