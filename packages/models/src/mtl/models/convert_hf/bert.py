"""BERT (``BertForMaskedLM``, ``BertForPreTraining``) and RoBERTa (``RobertaForMaskedLM``)
<-> mtl ``bert`` family (post-norm).

HF keeps separate query/key/value linears; we fuse them group-major (a group is one head
here). The decoder is tied to the word embeddings, so only its bias is stored. RoBERTa counts
positions from ``padding_idx + 1 = 2``: its position table keeps its two leading rows and
``model.position_offset = 2`` skips them, so a round trip is exact. The binary head
(``BertForPreTraining``: pooler + ``cls.seq_relationship``) maps to ``pooler`` / ``binary_head``.
``BertForSequenceClassification`` (pooler + ``classifier``, no MLM head) sets ``model.num_labels``
from its ``id2label`` and maps its head to ``pooler`` / ``classifier``, both ways.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf import HFArchitecture, HFConverter
from mtl.models.convert_hf.common import Read, check_resolved, fuse_qkv, split_qkv

ROBERTA_POSITION_OFFSET = 2  # padding_idx (1) + 1


def _section(hf: dict[str, Any], source: str, *, roberta: bool) -> dict[str, Any]:
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"{source}: hidden_act = {hf['hidden_act']!r} is not supported (mtl bert uses exact gelu)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{source}: position_embedding_type = {hf['position_embedding_type']!r}; only 'absolute' converts")
    offset = ROBERTA_POSITION_OFFSET if roberta else 0
    architectures = hf.get("architectures") or []
    num_labels = _num_labels(hf, source) if "BertForSequenceClassification" in architectures else 0
    if roberta and any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(f"{source}: RobertaForSequenceClassification's head (dense + out_proj on <s>) does not "
                          "convert; convert the RobertaForMaskedLM and fine-tune with model.num_labels")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    positions = hf["max_position_embeddings"] - offset
    return {
        "family": "bert", "norm_position": "post", "num_layers": hf["num_hidden_layers"], "hidden_size": hidden,
        "num_attention_heads": heads, "num_query_groups": heads, "head_dim": hidden // heads,
        "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "max_position_embeddings": positions, "seq_length": positions, "position_offset": offset,
        "type_vocab_size": hf.get("type_vocab_size", 2), "normalization": "layernorm",
        "norm_eps": hf.get("layer_norm_eps", 1e-12), "activation": "gelu", "position_embedding": "learned",
        "bias": True, "tie_embeddings": True,
        "binary_head": "BertForPreTraining" in architectures, "num_labels": num_labels,
    }


def _num_labels(hf: dict[str, Any], source: str) -> int:
    """HF stores the count as ``id2label``; ``problem_type`` says how the logits are read."""
    count = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
    problem = hf.get("problem_type")
    if count < 2 or problem not in (None, "single_label_classification"):
        raise ConfigError(f"{source}: a BertForSequenceClassification with {count} label(s) and problem_type = "
                          f"{problem!r} does not convert; mtl fine-tunes single-label classification over 2+ classes")
    return count


def bert_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return _section(hf, source, roberta=False)


def roberta_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return _section(hf, source, roberta=True)


def _names(roberta: bool) -> dict[str, str]:
    """The HF names that differ between the two architectures."""
    if roberta:
        return {"base": "roberta.", "transform": "lm_head.dense", "transform_norm": "lm_head.layer_norm",
                "decoder_bias": "lm_head.bias"}
    return {"base": "bert.", "transform": "cls.predictions.transform.dense",
            "transform_norm": "cls.predictions.transform.LayerNorm", "decoder_bias": "cls.predictions.bias"}


def _layer_pairs(i: int) -> list[tuple[str, str]]:
    """(ours, HF's under ``encoder.layer.{i}.``) for the layer's tensors other than q/k/v."""
    pairs = [("self_attention.linear_proj", "attention.output.dense"), ("post_attention_norm", "attention.output.LayerNorm"),
             ("mlp.linear_fc1", "intermediate.dense"), ("mlp.linear_fc2", "output.dense"),
             ("post_mlp_norm", "output.LayerNorm")]
    return [(f"layers.{i}.{ours}.{leaf}", f"encoder.layer.{i}.{hf}.{leaf}") for ours, hf in pairs for leaf in ("weight", "bias")]


def _embedding_and_head_pairs(section, roberta: bool) -> list[tuple[str, str]]:
    n = _names(roberta)
    emb = n["base"] + "embeddings."
    pairs = [("embedding.word_embeddings.weight", emb + "word_embeddings.weight"),
             ("embedding.position_embeddings.weight", emb + "position_embeddings.weight"),
             ("embedding.token_type_embeddings.weight", emb + "token_type_embeddings.weight"),
             ("embedding.norm.weight", emb + "LayerNorm.weight"), ("embedding.norm.bias", emb + "LayerNorm.bias")]
    if section.get("num_labels"):  # sequence classification: no MLM head
        return pairs + [(f"{ours}.{leaf}", f"{hf}.{leaf}") for ours, hf in
                        (("pooler.dense", "bert.pooler.dense"), ("classifier", "classifier")) for leaf in ("weight", "bias")]
    for leaf in ("weight", "bias"):
        pairs += [(f"lm_head.dense.{leaf}", f"{n['transform']}.{leaf}"), (f"lm_head.norm.{leaf}", f"{n['transform_norm']}.{leaf}")]
    pairs.append(("output_layer.bias", n["decoder_bias"]))
    if section["binary_head"]:
        for leaf in ("weight", "bias"):
            pairs += [(f"pooler.dense.{leaf}", f"bert.pooler.dense.{leaf}"), (f"binary_head.{leaf}", f"cls.seq_relationship.{leaf}")]
    return pairs


def _to_mtl(section: dict[str, Any], read: Read, roberta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    base, heads = _names(roberta)["base"], section["num_attention_heads"]
    for ours, hf in _embedding_and_head_pairs(section, roberta):
        yield ours, read(hf)
    for i in range(section["num_layers"]):
        attention = f"{base}encoder.layer.{i}.attention.self."
        for leaf in ("weight", "bias"):
            q, k, v = (read(f"{attention}{part}.{leaf}") for part in ("query", "key", "value"))
            yield f"layers.{i}.self_attention.linear_qkv.{leaf}", fuse_qkv(q, k, v, num_groups=heads)
        for ours, hf in _layer_pairs(i):
            yield ours, read(base + hf)


def bert_to_mtl(section, read: Read):
    return _to_mtl(section, read, roberta=False)


def roberta_to_mtl(section, read: Read):
    return _to_mtl(section, read, roberta=True)


# the tied decoder weight (and its bias's second name), position/type id buffers, an unused pooler
IGNORED = re.compile(r"^(cls\.predictions\.decoder\.(weight|bias)|lm_head\.decoder\.(weight|bias)"
                     r"|(bert|roberta)\.embeddings\.(position_ids|token_type_ids)|roberta\.pooler\..*)$")


def bert_ignored(section):
    if section["binary_head"] or section["num_labels"]:
        return IGNORED.match
    return lambda name: IGNORED.match(name) or name.startswith("bert.pooler.")


def check_bert_exportable(m) -> None:
    check_resolved(m)
    if m.family != "bert" or m.norm_position != "post" or m.num_query_groups != m.num_attention_heads:
        raise ConfigError(
            "BERT/RoBERTa export needs model.family = 'bert', model.norm_position = 'post' and plain multi-head "
            f"attention (have {m.family!r}, {m.norm_position!r}, {m.num_query_groups} groups for "
            f"{m.num_attention_heads} heads)"
        )


def _from_mtl(m, read: Read, roberta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    base = _names(roberta)["base"]
    section = {"binary_head": m.binary_head, "num_labels": m.num_labels}
    split = (m.num_attention_heads, m.num_query_groups, m.head_dim)
    for ours, hf in _embedding_and_head_pairs(section, roberta):
        yield hf, read(ours)
    for i in range(m.num_layers):
        attention = f"{base}encoder.layer.{i}.attention.self."
        for leaf in ("weight", "bias"):
            q, k, v = split_qkv(read(f"layers.{i}.self_attention.linear_qkv.{leaf}"), *split)
            for part, tensor in (("query", q), ("key", k), ("value", v)):
                yield f"{attention}{part}.{leaf}", tensor.contiguous()
        for ours, hf in _layer_pairs(i):
            yield base + hf, read(ours)


def bert_from_mtl(m, read: Read):
    return _from_mtl(m, read, roberta=False)


def roberta_from_mtl(m, read: Read):
    return _from_mtl(m, read, roberta=True)


def _config(m, dtype: torch.dtype, **arch) -> dict[str, Any]:
    return {
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "intermediate_size": m.ffn_hidden_size, "hidden_act": "gelu", "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings + m.position_offset,
        "type_vocab_size": m.type_vocab_size, "layer_norm_eps": m.norm_eps, "initializer_range": m.init_std,
        "hidden_dropout_prob": m.hidden_dropout, "attention_probs_dropout_prob": m.attention_dropout,
        "tie_word_embeddings": True, "position_embedding_type": "absolute",
        "dtype": str(dtype).removeprefix("torch."), **arch,
    }


def bert_config(m, dtype: torch.dtype) -> dict[str, Any]:
    if m.position_offset or not m.type_vocab_size:
        raise ConfigError(f"BERT export needs model.position_offset = 0 and model.type_vocab_size > 0 "
                          f"(have {m.position_offset}, {m.type_vocab_size}); a RoBERTa-shaped model exports as 'roberta'")
    if m.num_labels:
        labels = {"id2label": {str(i): f"LABEL_{i}" for i in range(m.num_labels)},
                  "label2id": {f"LABEL_{i}": i for i in range(m.num_labels)}}
        return _config(m, dtype, architectures=["BertForSequenceClassification"], model_type="bert", pad_token_id=0,
                       problem_type="single_label_classification", **labels)
    name = "BertForPreTraining" if m.binary_head else "BertForMaskedLM"
    return _config(m, dtype, architectures=[name], model_type="bert", pad_token_id=0)


def roberta_config(m, dtype: torch.dtype) -> dict[str, Any]:
    if m.position_offset != ROBERTA_POSITION_OFFSET or m.binary_head or m.num_labels or not m.type_vocab_size:
        raise ConfigError(f"RoBERTa export needs model.position_offset = 2, model.binary_head = false, "
                          f"model.num_labels = 0 and model.type_vocab_size > 0 (have {m.position_offset}, "
                          f"{m.binary_head}, {m.num_labels}, {m.type_vocab_size})")
    return _config(m, dtype, architectures=["RobertaForMaskedLM"], model_type="roberta", pad_token_id=1,
                   bos_token_id=0, eos_token_id=2)


def default_bert_architecture(m) -> str:
    return "roberta" if m.position_offset == ROBERTA_POSITION_OFFSET else "bert"


def bert_converter():
    """The ``hf`` converter of the ``bert`` family."""
    table = {
        "bert": HFArchitecture("bert", bert_model_section, bert_to_mtl, bert_ignored, check_bert_exportable,
                               bert_from_mtl, bert_config),
        "roberta": HFArchitecture("roberta", roberta_model_section, roberta_to_mtl, lambda s: IGNORED.match,
                                  check_bert_exportable, roberta_from_mtl, roberta_config),
    }
    return HFConverter(table, moe_types=(), default=default_bert_architecture)
