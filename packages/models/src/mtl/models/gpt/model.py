"""``GPTModel``: embedding -> transformer layers -> final norm -> vocab-parallel LM head.

One class covers GPT-2 style (learned positions, LayerNorm, GELU, biases, tied embeddings)
and Llama style (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head);
the config picks, the backend supplies the leaves. A pipeline stage builds only its part:
``pre_process`` (the embedding), ``post_process`` (final norm, LM head, loss) and the layers
of ``layer_range``. ``layer_spec`` is the one thing a gpt-like family changes (e.g. a
parallel attention + MLP block): ``layer_spec(config, backend) -> ModuleSpec`` of a layer whose
forward is ``(hidden [s(/tp), b, h], rotary, inference_context) -> hidden``.

The layers are plain modules; the model applies from outside them what changes how they are
called (``layer_calls.py``): the residual deferral under ``train.compile``, full recompute, and
CUDA-graph replay once the training step captures them.

It follows ``mtl.core.model_protocol.LanguageModel``, the contract every family's model keeps.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.registrations import Backend
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.cuda_graphs import capture_layer_graphs
from mtl.models.gpt.embedding import GPTEmbedding
from mtl.models.gpt.inference_context import InferenceContext
from mtl.models.gpt.layer_spec import layer_spec as gpt_layer_spec
from mtl.models.gpt.layer_calls import compile_units as block_compile_units
from mtl.models.gpt.layer_spec import norm_spec
from mtl.models.gpt.recompute import apply_full_recompute
from mtl.models.gpt.residual_deferral import apply_residual_deferral
from mtl.models.gpt.rope import RotaryEmbedding
from mtl.models.gpt.transformer_block import TransformerBlock
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs
from mtl.models.initialization import initialize_parameters, tag_weights
from mtl.models.param_layout import WORD_EMBEDDING, mark_tied_copy, mark_vocab_rows
from mtl.parallel.tensor_parallel import vocab_parallel_cross_entropy
from mtl.parallel.tensor_parallel.linear_cross_entropy import output_layer_cross_entropy, supports_fused_cross_entropy

LayerSpec = Callable[[RunConfig, Backend], ModuleSpec]


class GPTModel(nn.Module):
    def __init__(
        self,
        config: RunConfig,
        topology,
        backend: Backend,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_range: tuple[int, int] | None = None,
        layer_spec: LayerSpec = gpt_layer_spec,
    ):
        super().__init__()
        if not config.resolved:
            raise ConfigError("build_gpt needs a resolved config: call config.resolve(world_size, vocab_size) first")
        m = config.model
        self.config = config
        self.topology = topology
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel = config.parallel.sequence_parallel and topology.tp > 1
        self.vocab_size = m.vocab_size  # the true vocabulary; logits beyond it are padding
        self.input_tensor: torch.Tensor | None = None

        if pre_process:
            self.embedding = GPTEmbedding(
                padded_vocab_size=m.padded_vocab_size,
                hidden_size=m.hidden_size,
                max_position_embeddings=m.max_position_embeddings if m.position_embedding == "learned" else None,
                init_std=m.init_std,
                hidden_dropout=m.hidden_dropout,
                sequence_parallel=self.sequence_parallel,
                topology=topology,
            )
        self.rotary = RotaryEmbedding.from_config(m) if m.position_embedding == "rope" else None
        self.layers = TransformerBlock(
            layer_spec(config, backend),
            layer_range if layer_range is not None else (0, m.num_layers),
            m.num_layers,
            topology,
        )
        if config.train.compile:
            # speed only (the same numbers): each residual add runs in the next layer's compiled
            # norm kernel; a family's layers without the two branch methods keep the plain loop
            apply_residual_deferral(self.layers)
        if config.train.recompute == "full":
            apply_full_recompute(self.layers)
        if post_process:
            self.final_norm = build_module(
                norm_spec(config, backend, m.hidden_size),
                **sequence_parallel_norm_kwargs(self.sequence_parallel, topology),
            )
            self.output_layer = backend.column_linear(
                m.hidden_size,
                m.padded_vocab_size,
                bias=False,
                init_std=m.init_std,
                topology=topology,
                gather_output=False,
                sequence_parallel=self.sequence_parallel,
            )
            tag_weights(self.output_layer, "normal")
        if m.tie_embeddings:
            self._tie_embeddings()
        # Rows past the true vocabulary pad the tables to a multiple of 128·tp: invisible to
        # the layout (checkpoints, init, export) and, masked in the loss, to the math.
        if pre_process:
            mark_vocab_rows(self.embedding.word_embeddings.weight, m.vocab_size)
        if post_process:
            mark_vocab_rows(self.output_layer.weight, m.vocab_size)

    def _tie_embeddings(self) -> None:
        """One stage with both ends shares the Parameter. Split over pipeline stages, the
        last stage keeps its own copy (initialised from the same global tensor, see
        param_layout) and both are flagged so the pipeline all-reduces their gradients."""
        if self.pre_process and self.post_process:
            self.output_layer.weight = self.embedding.word_embeddings.weight
        elif self.pre_process:
            mark_tied_copy(self.embedding.word_embeddings.weight, None, WORD_EMBEDDING)
        elif self.post_process:
            mark_tied_copy(None, self.output_layer.weight, WORD_EMBEDDING)

    def compile_units(self) -> list[nn.Module]:
        """What ``train.compile`` compiles, one region each: the transformer layers (one
        graph serves them all) and the last stage's final norm (eager, its fp32 kernels and
        casts took ~2 ms of a 1.05 s step of the H100 reference model); embedding and head stay
        eager (the fused loss compiles its own chunk kernels). Under the residual deferral the
        layers' units are their deferred steps (``residual_deferral.py``)."""
        return [*block_compile_units(self.layers), *([self.final_norm] if self.post_process else [])]

    def gather_units(self) -> list[nn.Module]:
        """ZeRO-3's gather units, in forward order: the embedding, the compile units, the output
        layer. The two vocabulary tables (each 1 GB in bf16 for a 128k vocabulary at hidden 4096)
        are then gathered only around their own forward and backward, not for the whole step; a
        head tied to the embedding on this stage shares its unit's parameter (gathered twice)."""
        return [*([self.embedding] if self.pre_process else []), *self.compile_units(),
                *([self.output_layer] if self.post_process else [])]

    def capture_cuda_graphs(self, micro_batch_size: int) -> int:
        """``train.cuda_graphs``: capture each layer's training forward and backward for
        micro-batches of ``micro_batch_size`` (``cuda_graphs.py``); returns how many layers.
        Later calls check that nothing the graphs read has moved, and return 0."""
        return capture_layer_graphs(self, micro_batch_size, self.config.model.seq_length)

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """The hidden states ``[s(/tp), b, h]`` a later pipeline stage starts from."""
        self.input_tensor = input_tensor

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """input_ids [b, s] -> per-token fp32 loss [b, s] (with labels [b, s]), else logits
        [b, s, V/tp]; a stage without ``post_process`` returns hidden [s(/tp), b, h]."""
        hidden = self._stage_input(input_ids)
        seq_len, batch = self._sequence_and_batch(input_ids, hidden)
        if position_ids is None:
            offset = inference_context.sequence_offset if inference_context is not None else 0
            device = input_ids.device if input_ids is not None else hidden.device
            position_ids = torch.arange(offset, offset + seq_len, device=device).expand(batch, seq_len)
        if hidden is None:
            hidden = self.embedding(input_ids, position_ids)  # [s(/tp), b, h]
        rotary = self.rotary(position_ids) if self.rotary is not None else None  # [b, s, 1, d]
        hidden = self.layers(hidden, rotary, inference_context)
        if inference_context is not None:
            inference_context.advance(seq_len)
        if not self.post_process:
            return hidden
        hidden = self.final_norm(hidden)
        if labels is not None and supports_fused_cross_entropy(self.output_layer):
            # LM head + loss in chunks of tokens: no [s, b, V/tp] logits (linear_cross_entropy.py);
            # another backend's head (or output_layer.fused_cross_entropy = False) takes the path below.
            # train.compile compiles its chunk kernels on GPUs (on a CPU they gain nothing).
            compile_kernels = self.config.train.compile and hidden.is_cuda
            loss = output_layer_cross_entropy(
                self.output_layer, hidden, labels.t(), vocab_size=self.vocab_size, compile=compile_kernels
            )  # [s, b] fp32
            return loss.t()  # [b, s]
        logits = self.output_layer(hidden)  # [s(/tp), b, h] -> [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.topology, vocab_size=self.vocab_size)  # [s, b] fp32
        return loss.t()  # [b, s]

    def _stage_input(self, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        """None on the first stage (it embeds input_ids); the hidden states set by the pipeline otherwise."""
        if self.pre_process:
            if input_ids is None:
                raise ConfigError("the first pipeline stage needs input_ids [b, s]")
            return None
        if self.input_tensor is None:
            raise ConfigError("a later pipeline stage needs set_input_tensor(hidden [s, b, h]) before forward")
        return self.input_tensor

    def _sequence_and_batch(self, input_ids: torch.Tensor | None, hidden: torch.Tensor | None) -> tuple[int, int]:
        if input_ids is not None:
            return input_ids.shape[1], input_ids.shape[0]
        local_seq = hidden.shape[0]  # [s(/tp), b, h]
        return local_seq * (self.topology.tp if self.sequence_parallel else 1), hidden.shape[1]


def build_gpt(
    config: RunConfig,
    topology,
    backend: Backend,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    layer_range: tuple[int, int] | None = None,
    layer_spec: LayerSpec = gpt_layer_spec,
) -> GPTModel:
    """A GPT model (or one pipeline stage of it) from a resolved config, with the backend's
    leaves and the layers of ``layer_spec``, initialized from ``config.train.seed`` so that
    every parallel layout starts from the same global weights (``mtl.models.initialization``)."""
    model = GPTModel(
        config, topology, backend, pre_process=pre_process, post_process=post_process, layer_range=layer_range,
        layer_spec=layer_spec,
    )
    initialize_parameters(model, config.train.seed, topology)
    return model
