"""``docs/config.md``: every config key with its type, default and meaning, generated from the
``RunConfig`` dataclasses (names, types, defaults) and the comments beside their fields in
``mtl/core/config_sections.py`` (meanings); keys without a comment there take theirs from ``MEANINGS``.
A test checks that the committed file equals ``render()`` and that no key lacks a meaning.

    python -m mtl.cli.config_reference > docs/config.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from mtl.core.config_sections import CHOICES, SECTIONS

SECTION_INTRO = {
    "model": "The architecture. Changing any of these makes another model: a checkpoint of one is refused by the other.",
    "parallel": "The layout over processes. Never changes the numbers; any layout resumes any other's checkpoint.",
    "data": "What the run trains on. A `ckpt.save` directory belongs to one run: changing the data identity "
            "(paths, split, tokenizer, dataset) refuses it.",
    "train": "Optimisation, precision and the length of the run.",
    "ckpt": "Checkpoints: where, how often, and where a run starts from.",
    "logging": "Metrics and what the terminal shows.",
}

MEANINGS = {
    "model.family": "model family (a registry name; `mtl plugins` lists them)",
    "model.backend": "layer implementations (`local`, or a plugin's: `te`, `fp8`)",
    "model.num_layers": "transformer layers",
    "model.hidden_size": "width of the residual stream",
    "model.num_attention_heads": "query heads",
    "model.make_vocab_size_divisible_by": "the vocabulary is padded to a multiple of this times tp (padding never changes the numbers)",
    "model.tie_embeddings": "the output layer shares the input embedding's weights",
    "model.qk_norm": "normalise queries and keys before attention",
    "model.rope_theta": "RoPE base frequency",
    "model.seq_length": "tokens per sample",
    "model.normalization": "layernorm or rmsnorm",
    "model.norm_eps": "epsilon of the norms",
    "model.activation": "MLP activation: gelu, or swiglu (gated)",
    "model.position_embedding": "learned absolute positions, or rope",
    "model.bias": "biases in every linear layer (GPT-2 style)",
    "model.rope_scaling_factor": "llama3 RoPE scaling: the factor long wavelengths are divided by",
    "model.rope_low_freq_factor": "llama3 RoPE scaling: low-frequency band edge",
    "model.rope_high_freq_factor": "llama3 RoPE scaling: high-frequency band edge",
    "model.rope_original_max_position_embeddings": "llama3 RoPE scaling: the context length the model was trained at",
    "model.attention_dropout": "dropout on attention probabilities",
    "model.hidden_dropout": "dropout on the residual branches",
    "model.init_std": "standard deviation of the normal weight initialisation",
    "parallel.tp": "tensor-parallel size",
    "parallel.pp": "pipeline-parallel stages",
    "parallel.vpp": ("virtual pipeline chunks per stage (interleaved schedule; needs pp > 1): the 1F1B bubble "
                     "shrinks by this factor; on 2 H200s the reference model at pp=2 went from 86% to 90% of one "
                     "GPU's tokens/s per GPU at vpp=2 (benchmarks/RESULTS.md)"),
    "parallel.cp": "context-parallel size (the sequence split over ranks, ring attention)",
    "parallel.ep": "expert-parallel size (carved from the data-parallel ranks)",
    "parallel.sequence_parallel": "shard activations outside attention/MLP over the TP ranks (needs tp > 1)",
    "parallel.distributed_optimizer": "shard optimizer state and fp32 master weights over data-parallel ranks (ZeRO-1)",
    "parallel.overlap_grad_reduce": "reduce gradient buckets while backward runs",
    "parallel.bucket_size_mb": "gradient bucket size for the data-parallel reduce",
    "parallel.last_stage_layers": "layers on the last pipeline stage (see first_stage_layers)",
    "data.paths": 'preprocessed prefixes (`.bin/.idx` without the suffix): `["prefix"]`, or `[[0.7, "a"], [0.3, "b"]]` '
                  "to blend by (normalised) weight; data.dataset = 'classification': JSONL files of "
                  '`{"text", "text_pair" (optional), "label"}` lines, read in order',
    "data.split": "train, valid, test proportions of the documents (classification: of the JSONL lines)",
    "data.tokenizer": "tokenizer (a registry name: byte, hf, gpt2-bpe, sentencepiece, tiktoken)",
    "data.tokenizer_model": "the tokenizer's file or directory, where it needs one",
    "data.num_workers": "data loader worker processes",
    "data.mock_num_samples": "samples of the mock dataset",
    "train.micro_batch_size": ("samples per micro-batch per data-parallel rank. Where tp or cp split each "
                               "kernel's work, the host's launches per step stay as many and may bound the "
                               "rank: micro-batches of 8 took the reference model's tp=2+sp and cp=2 steps on "
                               "2 H200s from 53-68% to 82% of one GPU's tokens/s per GPU, 16 took tp=2+sp to 84%, "
                               "88-89% with parallel.async_tp (benchmarks/RESULTS.md)"),
    "train.global_batch_size": "samples per optimizer step, over all ranks and micro-batches",
    "train.iters": "optimizer steps of the whole run (a resumed run may change it: one warning line)",
    "train.exit_interval": "stop (and save) every N steps; the same command resumes (0: off)",
    "train.lr": "peak learning rate",
    "train.min_lr": "learning rate at the end of the decay",
    "train.lr_schedule": "constant, linear, cosine or wsd (warmup-stable-decay)",
    "train.weight_decay": "AdamW weight decay",
    "train.adam_beta1": "AdamW beta1",
    "train.adam_beta2": "AdamW beta2",
    "train.adam_eps": "AdamW epsilon",
    "train.clip_grad": "clip the global gradient norm to this (0: no clipping)",
    "train.precision": "fp32, bf16 or fp16 compute (the weights: train.params_dtype)",
    "train.seed": "seed of the weights, dropout and data order",
    "train.eval_interval": "evaluate on the valid split every N steps (0: never)",
    "train.eval_iters": "batches per evaluation",
    "train.initial_loss_scale": "fp16: starting loss scale",
    "train.loss_scale_window": "fp16: clean steps before the loss scale doubles",
    "train.min_loss_scale": "fp16: the loss scale never goes below this",
    "train.recompute": "activation recompute: none, selective (core attention) or full (per layer)",
    "train.compile": "torch.compile each transformer layer (derived: on where the run uses CUDA, off on CPU)",
    "ckpt.save": "directory to save into; when it holds this run's checkpoints the run resumes from its latest",
    "ckpt.load": "a checkpoint to start from (used when ckpt.save holds none of this run's yet)",
    "ckpt.interval": "save every N steps (0: only at the end, at exit_interval and on signals)",
    "ckpt.async_save": "write checkpoints in a background thread (zarr only)",
    "ckpt.format": "checkpoint format (a registry name; zarr is mtl's)",
    "ckpt.save_on_exit": "save when the run ends: at train.iters, at exit_interval, on SIGTERM or Ctrl-C",
    "logging.dir": "directory of metrics.jsonl (and tensorboard/)",
    "logging.interval": "log metrics every N steps",
    "logging.tensorboard": "also write TensorBoard scalars (pip install 'mtl-train[tensorboard]')",
    "logging.callbacks": "metric sinks (registry names: jsonl, tensorboard, or a plugin's)",
}


def source_comments(cls: type) -> dict[str, str]:
    """field name -> the comment on its line, or the comment lines right above it."""
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s*(.*))?$", line)
        if match:
            parts = [*above, *([match.group(2).strip()] if match.group(2) else [])]
            if parts:
                comments[match.group(1)] = " ".join(parts)
        above = []
    return comments


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]`"
    return f"`{value}`"


def _type(f: dataclasses.Field) -> str:
    return str(f.type).replace("| None", "").replace(" ", "") if isinstance(f.type, str) else f.type.__name__


def meaning(section: str, f: dataclasses.Field, comments: dict[str, str]) -> str:
    text = comments.get(f.name) or MEANINGS.get(f"{section}.{f.name}", "")
    choices = CHOICES.get(f"{section}.{f.name}")
    if choices and not all(c in text for c in choices):
        text = f"{text} (one of {', '.join(choices)})" if text else f"one of {', '.join(choices)}"
    return text.replace("|", "\\|")


def missing_meanings() -> list[str]:
    out = []
    for section, cls in SECTIONS.items():
        comments = source_comments(cls)
        out += [f"{section}.{f.name}" for f in dataclasses.fields(cls) if not meaning(section, f, comments)]
    return out


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m mtl.cli.config_reference > docs/config.md`; "
        "packages/cli/tests/test_config_reference.py checks it -->",
        "",
        "`mtl train CONFIG.toml --set section.key=value` reads these keys (TOML tables `[model]`, `[parallel]`, ...; "
        "`--set` values are parsed as TOML, else taken as a string). Keys marked *derived* are filled by "
        "`RunConfig.resolve` and may be set explicitly; `mtl train CONFIG --dry-run` prints every resolved value.",
        "",
    ]
    for section, cls in SECTIONS.items():
        comments = source_comments(cls)
        lines += [f"## [{section}]", "", SECTION_INTRO.get(section, ""), "", "| key | type | default | meaning |",
                  "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            lines.append(f"| `{section}.{f.name}` | {_type(f)} | {_default(f)} | {meaning(section, f, comments)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
