"""``EncoderModel``: the ``bert`` family's model. Embedding (word + position + token type, with
the embedding norm when post-norm) -> encoder layers (bidirectional, padding-masked) -> final
norm (pre-norm only) -> MLM head with the tied decoder, and optionally pooler + binary head;
or, with ``model.num_labels``, pooler + dropout + ``classifier`` (sequence classification).

A pipeline stage builds its part (``pre_process``: the embedding; ``post_process``: the norm
and heads; ``layer_range``: its layers), as ``GPTModel`` does, with the same parameter-layout
records: the decoder is ``output_layer`` tied to ``embedding.word_embeddings`` (a copy on a
last stage that does not hold the embedding). Every stage reads the micro-batch, so each
gets the padding mask from it.

It follows ``mtl.core.model_protocol.LanguageModel``; with ``labels`` its last stage returns the
dict of per-token and per-sample terms that ``mtl.models.bert.loss.encoder_loss`` reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.registrations import Backend
from mtl.core.spec import build_module
from mtl.models.bert.embedding import EncoderEmbedding
from mtl.models.bert.heads import MaskedLMTransform, Pooler, replicated_linear
from mtl.models.bert.layer import encoder_layer_spec
from mtl.models.bert.vocab_hits import vocab_parallel_hits
from mtl.models.gpt.layer_spec import norm_spec
from mtl.models.gpt.recompute import checkpointed
from mtl.models.gpt.transformer_block import TransformerBlock
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs
from mtl.models.initialization import initialize_parameters, tag_weights
from mtl.models.param_layout import WORD_EMBEDDING, mark_tied_copy, mark_vocab_rows
from mtl.parallel.tensor_parallel import gather_from_sequence_parallel, vocab_parallel_cross_entropy


class EncoderModel(nn.Module):
    def __init__(self, config: RunConfig, topology, backend: Backend, *, pre_process: bool = True,
                 post_process: bool = True, layer_range: tuple[int, int] | None = None, layer_spec=None):
        super().__init__()
        m = config.model
        self.config, self.topology = config, topology
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = config.parallel.sequence_parallel and topology.tp > 1
        self.vocab_size = m.vocab_size
        self.input_tensor: torch.Tensor | None = None
        hidden = m.hidden_size
        if pre_process:
            self.embedding = EncoderEmbedding(
                padded_vocab_size=m.padded_vocab_size, hidden_size=hidden,
                max_position_embeddings=m.max_position_embeddings, position_offset=m.position_offset,
                type_vocab_size=m.type_vocab_size, init_std=m.init_std, hidden_dropout=m.hidden_dropout,
                sequence_parallel=self.sequence_parallel, topology=topology,
                norm=norm_spec(config, backend, hidden) if m.norm_position == "post" else None,
            )
            mark_vocab_rows(self.embedding.word_embeddings.weight, m.vocab_size)
        spec = (layer_spec or encoder_layer_spec)(config, backend)
        self.layers = TransformerBlock(spec, layer_range or (0, m.num_layers), m.num_layers, topology)
        if post_process:
            if m.norm_position == "pre":
                self.final_norm = build_module(
                    norm_spec(config, backend, hidden), **sequence_parallel_norm_kwargs(self.sequence_parallel, topology)
                )
            if m.num_labels:  # named as HF names them, so a converted pooler loads into ours
                self.pooler = Pooler(hidden)
                self.classifier = replicated_linear(hidden, m.num_labels)
            else:
                self._build_pretraining_heads(backend)
        if not m.num_labels:
            self._tie_decoder()
        initialize_parameters(self, config.train.seed, topology)

    def _build_pretraining_heads(self, backend: Backend) -> None:
        m = self.config.model
        self.lm_head = MaskedLMTransform(hidden_size=m.hidden_size, norm=norm_spec(self.config, backend, m.hidden_size))
        self.output_layer = backend.column_linear(
            m.hidden_size, m.padded_vocab_size, bias=True, init_std=m.init_std, topology=self.topology,
            gather_output=False, sequence_parallel=False,  # the head reads the gathered sequence
        )
        tag_weights(self.output_layer, "normal")
        mark_vocab_rows(self.output_layer.weight, m.vocab_size)
        mark_vocab_rows(self.output_layer.bias, m.vocab_size)
        if m.binary_head:
            self.pooler = Pooler(m.hidden_size)
            self.binary_head = replicated_linear(m.hidden_size, 2)

    @property
    def finetune_heads(self) -> tuple[str, ...]:
        """Global-name prefixes of the weights a fine-tuning start may initialise afresh where its
        checkpoint lacks them (a masked-LM checkpoint has no classifier) or holds another shape."""
        return ("pooler.", "classifier.") if self.config.model.num_labels and self.post_process else ()

    def _tie_decoder(self) -> None:
        """The decoder reads the word table (as gpt's tied head; see GPTModel._tie_embeddings)."""
        if self.pre_process and self.post_process:
            self.output_layer.weight = self.embedding.word_embeddings.weight
        elif self.pre_process:
            mark_tied_copy(self.embedding.word_embeddings.weight, None, WORD_EMBEDDING)
        elif self.post_process:
            mark_tied_copy(None, self.output_layer.weight, WORD_EMBEDDING)

    def compile_units(self) -> list[nn.Module]:
        """The encoder layers, one region each (one graph serves them all)."""
        return list(self.layers.values())

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        self.input_tensor = input_tensor

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inference_context=None, *,
                token_type_ids: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                binary_labels: torch.Tensor | None = None, sequence_labels: torch.Tensor | None = None):
        """input_ids, token_type_ids, padding_mask (1: a real token) [b, s] -> hidden [s(/tp), b, h]
        on a stage without ``post_process``; on the last: logits [b, s, V/tp] without labels, else
        {"mlm_loss", "mlm_hits": [b, s] fp32, and with binary_labels [b] "binary_loss": [b]}.
        With ``model.num_labels``: logits [b, num_labels] fp32, or with sequence_labels [b]
        {"sequence_loss", "sequence_hits": [b] fp32}."""
        if inference_context is not None:
            raise ConfigError("model.family = 'bert' is an encoder: it has no KV-cache generation")
        hidden = self.encode(input_ids, position_ids, token_type_ids, padding_mask)
        if not self.post_process:
            return hidden
        if self.config.model.num_labels:
            return self._classify(hidden, sequence_labels)
        return self._heads(hidden, labels, binary_labels)

    def encode(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
               token_type_ids: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's embedding (first stage) and layers: hidden [s(/tp), b, h], before the final norm."""
        if self.pre_process:
            if input_ids is None:
                raise ConfigError("the first pipeline stage needs input_ids [b, s]")
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            hidden = self.embedding(input_ids, position_ids, token_type_ids)  # [s(/tp), b, h]
        elif self.input_tensor is None:
            raise ConfigError("a later pipeline stage needs set_input_tensor(hidden [s, b, h]) before forward")
        else:
            hidden = self.input_tensor
        mask = self._attention_mask(padding_mask)
        recompute = self.config.train.recompute == "full" and self.training
        for layer in self.layers.values():
            # full recompute: the layer's call checkpointed, the mask among its arguments
            hidden = checkpointed(layer, hidden, mask) if recompute else layer(hidden, mask)
        return hidden

    def _attention_mask(self, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """[b, s(/cp)] bool (True: a real token), or None where no key is padding: one host read
        per micro-batch, and without padding the backend's own attention runs. Under context
        parallelism every cp rank must take the same path (the masked one gathers over them), and a
        rank's chunks alone cannot say whether the others hold padding: the mask is always kept."""
        if padding_mask is None:
            return None
        real = padding_mask == 1
        if self.topology.cp == 1 and bool(real.all()):
            return None
        return real

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output as every head reads it: normed (pre-norm), whole ([s, b, h])."""
        if self.config.model.norm_position == "pre":
            hidden = self.final_norm(hidden)
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; each rank then computes the whole head
            hidden = gather_from_sequence_parallel(hidden, self.topology.tp_group, grad_is_partial=False)
        return hidden

    def _classify(self, hidden: torch.Tensor, sequence_labels: torch.Tensor | None):
        """Pooler on [CLS], dropout (HF's hidden_dropout_prob), classifier: logits [b, num_labels]."""
        pooled = self.pooler(self._head_input(hidden))  # [b, h]
        pooled = F.dropout(pooled, p=self.config.model.hidden_dropout, training=self.training)
        logits = self.classifier(pooled).float()  # [b, num_labels]
        if sequence_labels is None:
            return logits
        return {"sequence_loss": F.cross_entropy(logits, sequence_labels, reduction="none"),
                "sequence_hits": (logits.detach().argmax(-1) == sequence_labels).float()}

    def _heads(self, hidden: torch.Tensor, labels, binary_labels):
        hidden = self._head_input(hidden)
        logits = self.output_layer(self.lm_head(hidden))  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        # unmasked positions carry label -1 (Megatron's datasets); their loss_mask is 0
        target = labels.clamp(min=0).t()  # [s, b]
        out = {
            "mlm_loss": vocab_parallel_cross_entropy(logits, target, self.topology, vocab_size=self.vocab_size).t(),
            "mlm_hits": vocab_parallel_hits(logits.detach(), target, self.topology, self.vocab_size).t(),
        }
        if self.config.model.binary_head and binary_labels is not None:
            binary_logits = self.binary_head(self.pooler(hidden)).float()  # [b, 2]
            out["binary_loss"] = F.cross_entropy(binary_logits, binary_labels, reduction="none")
        return out


def build_encoder(config: RunConfig, topology, backend: Backend, **stage) -> EncoderModel:
    """An encoder (or one pipeline stage of it), initialised from ``config.train.seed``."""
    return EncoderModel(config, topology, backend, **stage)
