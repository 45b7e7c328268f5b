"""The key/value cache of incremental decoding, shared by all layers of one model (stage)."""

from __future__ import annotations

from typing import Any

import torch

from mtl.core.errors import ConfigError


class InferenceContext:
    """Keys and values of the tokens seen so far, per layer, preallocated to a maximum length.

    ``sequence_offset`` is how many tokens are already cached: the next forward's tokens take
    positions ``offset .. offset + s - 1``. ``GPTModel.forward`` advances it after each call.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_offset = 0
        self._keys: dict[int, torch.Tensor] = {}  # layer number -> [b, max_s, groups, d]
        self._values: dict[int, torch.Tensor] = {}
        # what a recurrent layer (a Mamba-2 mixer) carries from one forward to the next, by its
        # layer number: its own tuple of per-sequence states, replaced after each call
        self.recurrent_states: dict[int, Any] = {}

    def append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key/value [b, s, groups, d] after the cached tokens; return all of them
        [b, offset + s, groups, d]."""
        batch, new_tokens = key.shape[0], key.shape[1]
        end = self.sequence_offset + new_tokens
        if end > self.max_sequence_length or batch > self.max_batch_size:
            raise ConfigError(
                f"the KV cache holds {self.max_batch_size} sequences of {self.max_sequence_length} "
                f"tokens; asked for {batch} x {end}: create the InferenceContext larger"
            )
        if layer_number not in self._keys:
            shape = (self.max_batch_size, self.max_sequence_length, *key.shape[2:])
            self._keys[layer_number] = key.new_zeros(shape)
            self._values[layer_number] = value.new_zeros(shape)
        keys, values = self._keys[layer_number], self._values[layer_number]
        keys[:batch, self.sequence_offset : end] = key
        values[:batch, self.sequence_offset : end] = value
        return keys[:batch, :end], values[:batch, :end]

    def advance(self, num_tokens: int) -> None:
        self.sequence_offset += num_tokens

    def reset(self) -> None:
        self.sequence_offset = 0
        self._keys.clear()
        self._values.clear()
        self.recurrent_states.clear()
