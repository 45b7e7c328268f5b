"""``T5Model``: T5's encoder-decoder from gpt's leaves where they fit (embedding, self-attention
with its fused QKV, the backend's linears and RMS norm) and T5's own pieces (relative position
bias, cross-attention, ReLU / gated-GELU MLP).

    encoder: embed -> N x [h += self_attn(norm(h)) with the bidirectional position bias;
             h += mlp(norm(h))] -> final norm
    decoder: embed -> M x [h += self_attn(norm(h)) with the causal position bias;
             h += cross_attn(norm(h), encoder output); h += mlp(norm(h))] -> final norm
    head:    the embedding (tied) or its own table; T5 1.0 scales the decoder output by h^-0.5 first

Each stack holds one position-bias table (T5 keeps it in its first layer and shares it with
the others). One process, tensor, sequence and data parallelism (heads, MLP and vocabulary split
over TP; under SP the hidden states of both stacks are sequence shards), selective or full
recompute, pipeline stages (encoder stages, then decoder stages: ``stage_payload.py``); not context
parallelism (see the package README). Generation caches the
decoder's self-attention keys and values and the cross-attention's (``EncoderDecoderContext``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.core.errors import ConfigError
from mtl.core.registrations import Backend
from mtl.models.gpt.embedding import GPTEmbedding
from mtl.models.gpt.inference_context import InferenceContext
from mtl.models.gpt.recompute import checkpointed
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs
from mtl.models.initialization import initialize_parameters, tag_weights
from mtl.models.param_layout import WORD_EMBEDDING, mark_tied_copy, mark_vocab_rows
from mtl.models.t5.layer import T5Layer, sequence_parallel_dropout
from mtl.models.t5.relative_position import RelativePositionBias
from mtl.models.t5.stage_payload import StagePayload
from mtl.parallel.tensor_parallel import vocab_parallel_cross_entropy


@dataclass(frozen=True)
class T5Shape:
    """Resolved numbers of one T5 model (what ``convert_hf/t5.py`` reads from a config.json)."""

    vocab_size: int
    padded_vocab_size: int
    hidden_size: int
    num_layers: int
    num_decoder_layers: int
    num_attention_heads: int
    head_dim: int
    ffn_hidden_size: int
    activation: str  # "relu" (T5 1.0) or "gated-gelu" (T5 1.1, Flan-T5)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    scale_decoder_output: bool = True  # T5 1.0: the decoder output times hidden_size**-0.5 before the head
    init_std: float = 0.02
    dropout: float = 0.0
    sequence_parallel: bool = False  # parallel.sequence_parallel at tp > 1: hidden states [s/tp, b, h]
    recompute: str = "none"  # train.recompute: 'selective' (core attentions) or 'full' (whole layers)


class T5Stack(nn.Module):
    """The encoder or the decoder, or the part of it one pipeline stage holds: the layers ``held``
    (indices within the stack), the position-bias table where ``with_table`` (the first stage), the
    final norm where the stack's last layer is held. A stage holding none of its layers passes
    the hidden states through."""

    def __init__(self, shape: T5Shape, backend: Backend, topology, *, decoder: bool, held: range | None = None,
                 with_table: bool = True):
        super().__init__()
        count = shape.num_decoder_layers if decoder else shape.num_layers
        held = range(count) if held is None else held
        self.relative_position_bias = RelativePositionBias(
            num_buckets=shape.relative_attention_num_buckets, max_distance=shape.relative_attention_max_distance,
            num_heads=shape.num_attention_heads, bidirectional=not decoder, topology=topology) if with_table else None
        self.layers = nn.ModuleDict({
            str(i): T5Layer(shape, backend, topology, layer_number=i, cross=decoder,
                            sequence_parallel=shape.sequence_parallel, recompute_attention=shape.recompute == "selective")
            for i in held})
        self.starts = len(held) > 0 and held.start == 0  # the embedding's dropout belongs to the stack's start
        self.final_norm = backend.norm(shape.hidden_size, kind="rmsnorm", eps=shape.norm_eps,
                                       **sequence_parallel_norm_kwargs(shape.sequence_parallel, topology)) \
            if len(held) > 0 and held.stop == count else None
        self.decoder = decoder
        self.sequence_parallel, self.full_recompute = shape.sequence_parallel, shape.recompute == "full"
        self.tp = topology.tp if topology is not None else 1
        self.dropout = nn.Dropout(shape.dropout)

    def forward(self, hidden, key_padding: torch.Tensor | None, encoder_output=None, encoder_padding=None,
                inference_context=None, table: torch.Tensor | None = None):
        """hidden [s(/tp), b, h]; paddings [b, s] bool (True: a real token) -> [s(/tp), b, h]. With an
        ``inference_context`` (decoder) the queries are the ``s`` tokens after the cached ones.
        ``table`` [1, heads/tp, s, s]: the position bias computed upstream (pipeline stages)."""
        if not self.layers:
            return hidden
        s = hidden.shape[0] * (self.tp if self.sequence_parallel else 1)  # the biases span the whole sequence
        offset = inference_context.sequence_offset if inference_context is not None else 0
        bias = table if table is not None else self.relative_position_bias(s, offset + s, offset)
        if self.decoder:
            causal = torch.ones(s, offset + s, dtype=torch.bool, device=bias.device).tril(diagonal=offset)
            bias = bias.masked_fill(~causal, MASKED)
        if key_padding is not None:
            bias = bias.masked_fill(~key_padding[:, None, None, :], MASKED)  # -> [b, heads/tp, s, s]
        cross_bias = None
        if self.decoder and encoder_padding is not None:
            cross_bias = torch.zeros(encoder_padding.shape, device=hidden.device).masked_fill(
                ~encoder_padding, MASKED)[:, None, None, :]  # [b, 1, 1, s_enc]
        if self.starts:
            hidden = sequence_parallel_dropout(self.dropout, hidden, self.sequence_parallel)
        recompute = self.full_recompute and self.training and inference_context is None
        for layer in self.layers.values():
            if recompute:  # train.recompute = 'full': the biases are arguments, set again on the recompute
                hidden = checkpointed(layer, hidden, bias, encoder_output, cross_bias)
            else:
                hidden = layer(hidden, bias, encoder_output, cross_bias, inference_context)
        if self.final_norm is None:
            return hidden
        return sequence_parallel_dropout(self.dropout, self.final_norm(hidden), self.sequence_parallel)


MASKED = torch.finfo(torch.float32).min  # as HF: a masked score is the lowest float, not -inf


class EncoderDecoderContext(InferenceContext):
    """gpt's self-attention KV cache, plus each decoder layer's cross-attention keys and values
    (projected from the encoder output once, at the first step)."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        super().__init__(max_batch_size, max_sequence_length)
        self.cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def reset(self) -> None:
        super().reset()
        self.cross_kv.clear()


class T5Model(nn.Module):
    """Follows ``mtl.core.model_protocol.LanguageModel``: the whole model, or one pipeline stage
    holding global layers ``layer_range`` of the encoder's then the decoder's (stages exchange a
    ``StagePayload``; the first embeds both token streams, the last holds the head)."""

    def __init__(self, shape: T5Shape, topology, backend: Backend, config=None, *, pre_process: bool = True,
                 post_process: bool = True, layer_range: tuple[int, int] | None = None):
        super().__init__()
        self.shape, self.topology, self.config = shape, topology, config
        self.pre_process, self.post_process = pre_process, post_process
        encoders = shape.num_layers
        start, end = layer_range if layer_range is not None else (0, encoders + shape.num_decoder_layers)
        pipelined = not (pre_process and post_process)
        self.payload = StagePayload.from_config(config) if pipelined else None
        self.input_tensor: torch.Tensor | None = None
        if pre_process:
            self.embedding = GPTEmbedding(padded_vocab_size=shape.padded_vocab_size, hidden_size=shape.hidden_size,
                                          max_position_embeddings=None, init_std=shape.init_std, hidden_dropout=0.0,
                                          sequence_parallel=shape.sequence_parallel, topology=topology)
            mark_vocab_rows(self.embedding.word_embeddings.weight, shape.vocab_size)
        self.encoder = T5Stack(shape, backend, topology, decoder=False, with_table=pre_process,
                               held=range(min(start, encoders), min(end, encoders)))
        self.decoder = T5Stack(shape, backend, topology, decoder=True, with_table=pre_process,
                               held=range(max(start, encoders) - encoders, max(end, encoders) - encoders))
        if post_process:
            self.output_layer = backend.column_linear(shape.hidden_size, shape.padded_vocab_size, bias=False,
                                                      init_std=shape.init_std, topology=topology, gather_output=False,
                                                      sequence_parallel=shape.sequence_parallel)
            tag_weights(self.output_layer, "normal")
            mark_vocab_rows(self.output_layer.weight, shape.vocab_size)
        if shape.tie_embeddings:
            self._tie_embeddings()

    def _tie_embeddings(self) -> None:
        """As gpt's: split over stages, each end keeps a copy, their gradients summed by the pipeline."""
        if self.pre_process and self.post_process:
            self.output_layer.weight = self.embedding.word_embeddings.weight
        elif self.pre_process:
            mark_tied_copy(self.embedding.word_embeddings.weight, None, WORD_EMBEDDING)
        elif self.post_process:
            mark_tied_copy(None, self.output_layer.weight, WORD_EMBEDDING)

    def compile_units(self) -> list[nn.Module]:
        return [*self.encoder.layers.values(), *self.decoder.layers.values()]

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """A later pipeline stage's input: the previous stage's ``StagePayload``, flat."""
        self.input_tensor = input_tensor

    def encode(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, s_enc], padding_mask [b, s_enc] (1: a real token) -> [s_enc(/tp), b, h]."""
        if self.payload is not None:
            raise ConfigError("T5Model.encode needs the whole model (parallel.pp = 1)")
        real = padding_mask.bool() if padding_mask is not None else None
        return self.encoder(self.embedding(input_ids, None), real)

    def forward(self, input_ids: torch.Tensor, position_ids=None, labels: torch.Tensor | None = None,
                inference_context=None, *, decoder_input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
                decoder_padding_mask: torch.Tensor | None = None,
                encoder_output: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, s_enc], decoder_input_ids [b, s_dec] -> logits [b, s_dec, V/tp], or with
        ``labels`` [b, s_dec] (-1 on padding) the per-token fp32 loss [b, s_dec]; a stage without
        ``post_process`` returns its flat ``StagePayload``. T5's positions are relative:
        ``position_ids`` is not read. ``encoder_output`` [s_enc(/tp), b, h] skips the encoder."""
        if inference_context is not None and not isinstance(inference_context, EncoderDecoderContext):
            raise ConfigError("model.family = 't5' decodes with an mtl.models.t5.generate.EncoderDecoderContext "
                              "(it also caches the cross-attention's keys and values)")
        real = padding_mask.bool() if padding_mask is not None else None
        decoder_real = decoder_padding_mask.bool() if decoder_padding_mask is not None else None
        if self.payload is None:  # the whole model
            if encoder_output is None:
                encoder_output = self.encode(input_ids, padding_mask)
            hidden = self.decoder(self.embedding(decoder_input_ids, None), decoder_real, encoder_output, real,
                                  inference_context)
            if inference_context is not None:
                inference_context.advance(decoder_input_ids.shape[1])
        else:
            encoder_output, hidden, encoder_table, decoder_table = self._stage_inputs(input_ids, decoder_input_ids)
            encoder_output = self.encoder(encoder_output, real, table=encoder_table)
            hidden = self.decoder(hidden, decoder_real, encoder_output, real, table=decoder_table)
            if not self.post_process:
                return self.payload.pack(encoder_output, hidden, encoder_table, decoder_table)
        return self._head(hidden, labels)

    def _stage_inputs(self, input_ids, decoder_input_ids):
        """The first stage embeds both streams and computes both tables; a later one unpacks its input."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise ConfigError("a later t5 pipeline stage needs set_input_tensor(payload) before forward")
            return self.payload.unpack(self.input_tensor)
        p = self.payload
        return (self.embedding(input_ids, None), self.embedding(decoder_input_ids, None),
                self.encoder.relative_position_bias(p.encoder_length, p.encoder_length),
                self.decoder.relative_position_bias(p.decoder_length, p.decoder_length))

    def _head(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if self.shape.scale_decoder_output:  # T5 1.0 rescales before its (tied) head
            hidden = hidden * self.shape.hidden_size ** -0.5
        logits = self.output_layer(hidden)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        target = labels.clamp(min=0).t()  # [s, b]; padded positions carry -1 and loss_mask 0
        return vocab_parallel_cross_entropy(logits, target, self.topology, vocab_size=self.shape.vocab_size).t()


def shape_from_config(config) -> T5Shape:
    m = config.model
    return T5Shape(
        vocab_size=m.vocab_size, padded_vocab_size=m.padded_vocab_size, hidden_size=m.hidden_size,
        num_layers=m.num_layers, num_decoder_layers=m.num_decoder_layers, num_attention_heads=m.num_attention_heads,
        head_dim=m.head_dim, ffn_hidden_size=m.ffn_hidden_size, activation=m.activation,
        relative_attention_num_buckets=m.relative_attention_num_buckets,
        relative_attention_max_distance=m.relative_attention_max_distance, norm_eps=m.norm_eps,
        tie_embeddings=m.tie_embeddings, scale_decoder_output=m.scale_decoder_output, init_std=m.init_std,
        dropout=m.hidden_dropout, sequence_parallel=config.parallel.sequence_parallel and config.parallel.tp > 1,
        recompute=config.train.recompute,
    )


def build_t5(config, topology, backend: Backend, *, pre_process: bool = True, post_process: bool = True,
             layer_range=None) -> T5Model:
    """The whole T5, or one pipeline stage of it, from a resolved config, initialised from
    ``config.train.seed`` (the same global weights at every layout)."""
    model = T5Model(shape_from_config(config), topology, backend, config, pre_process=pre_process,
                    post_process=post_process, layer_range=layer_range)
    initialize_parameters(model, config.train.seed, topology)
    return model
