"""What one t5 pipeline stage sends the next: one flat tensor holding

    encoder hidden  [s_enc(/tp), b, h]   the encoder's states, its output after the last encoder stage
    decoder hidden  [s_dec(/tp), b, h]   the decoder's states (its embedding on the encoder stages)
    encoder table   [1, heads/tp, s_enc, s_enc]  relative position bias, before the padding mask
    decoder table   [1, heads/tp, s_dec, s_dec]  likewise, before the causal and padding masks

The first stage embeds both token streams and computes both position-bias tables (it holds the
embedding and both tables' weights); the encoder stages advance the first part and carry the
others, the decoder stages read the encoder output as cross-attention's keys and values and
advance the second part. Everything a stage uses from upstream is a slice of the tensor it
received, so the gradient the schedule sends back holds the encoder output's gradient (summed
over every decoder stage that attended to it) and the tables' (summed over every layer, reaching
their one copy on the first stage). One copy of each table: no gradient sync between stages and
one global tensor in checkpoints. Megatron's ``pipeline_model_parallel_split_rank`` T5 sends
the encoder output alongside the decoder's states the same way (without the tables: its T5 has
absolute positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StagePayload:
    encoder_tokens: int  # s_enc, /tp under sequence parallelism
    decoder_tokens: int
    micro_batch: int
    hidden: int
    local_heads: int  # heads/tp
    encoder_length: int  # s_enc: the tables span the whole sequences
    decoder_length: int

    @classmethod
    def from_config(cls, config) -> "StagePayload":
        m, p, d = config.model, config.parallel, config.data
        shard = p.tp if p.sequence_parallel and p.tp > 1 else 1
        return cls(m.seq_length // shard, d.decoder_seq_length // shard, config.train.micro_batch_size, m.hidden_size,
                   m.num_attention_heads // p.tp, m.seq_length, d.decoder_seq_length)

    def _shapes(self) -> list[tuple[int, ...]]:
        return [(self.encoder_tokens, self.micro_batch, self.hidden), (self.decoder_tokens, self.micro_batch, self.hidden),
                (1, self.local_heads, self.encoder_length, self.encoder_length),
                (1, self.local_heads, self.decoder_length, self.decoder_length)]

    @property
    def numel(self) -> int:
        return sum(torch.Size(shape).numel() for shape in self._shapes())

    def pack(self, encoder: torch.Tensor, decoder: torch.Tensor, encoder_table: torch.Tensor,
             decoder_table: torch.Tensor) -> torch.Tensor:
        """-> [numel] in the hidden states' dtype (the tables, fp32 from weights of that dtype, convert exactly)."""
        parts = (encoder, decoder, encoder_table, decoder_table)
        for part, shape in zip(parts, self._shapes()):
            if tuple(part.shape) != shape:
                raise ValueError(f"t5 stage payload: a part of shape {tuple(part.shape)} where {shape} belongs")
        return torch.cat([part.reshape(-1).to(encoder.dtype) for part in parts])

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The received tensor -> (encoder hidden, decoder hidden, encoder table fp32, decoder table fp32)."""
        shapes = self._shapes()
        parts = flat.split([torch.Size(shape).numel() for shape in shapes])
        encoder, decoder, encoder_table, decoder_table = (part.view(shape) for part, shape in zip(parts, shapes))
        return encoder, decoder, encoder_table.float(), decoder_table.float()


def pipeline_tensor_shape(config) -> tuple[int]:
    """``ModelFamily.pipeline_tensor_shape`` for t5."""
    return (StagePayload.from_config(config).numel,)
