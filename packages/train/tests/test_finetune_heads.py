"""``leave_fresh_heads``: a fine-tuning start leaves out of the load the head weights the
checkpoint lacks or holds in another shape (a classifier over 3 labels for a 2-label model),
loads the rest (the pooler of the same shape), and says which in one line."""

import logging

import torch
from torch import nn

from mtl.ckpt import ShardedTensor, save
from mtl.train.finetune_heads import leave_fresh_heads


class TwoLabelModel(nn.Module):
    finetune_heads = ("pooler.", "classifier.")


def sharded(key, shape):
    return ShardedTensor(f"model.{key}", torch.zeros(shape), shape, (0,) * len(shape))


def test_head_of_another_shape_starts_fresh(tmp_path, caplog):
    stored = {f"model.{k}": ShardedTensor(f"model.{k}", torch.ones(shape), shape, (0,) * len(shape))
              for k, shape in [("layers.0.w", (4, 4)), ("pooler.dense.weight", (4, 4)), ("classifier.weight", (3, 4)),
                               ("lm_head.dense.weight", (4, 4))]}
    save(stored, str(tmp_path), 1, {"iteration": 1})
    template = {s.key: s for s in (sharded("layers.0.w", (4, 4)), sharded("pooler.dense.weight", (4, 4)),
                                   sharded("classifier.weight", (2, 4)), sharded("classifier.bias", (2,)))}
    with caplog.at_level(logging.INFO, logger="mtl"):
        leave_fresh_heads(template, [TwoLabelModel()], str(tmp_path), 1)
    assert sorted(template) == ["model.layers.0.w", "model.pooler.dense.weight"]
    (line,) = [r.getMessage() for r in caplog.records if "finetune_from" in r.getMessage()]
    assert "classifier.weight (stored (3, 4), here (2, 4))" in line and "classifier.bias (not in the checkpoint)" in line
    assert "left out (no place in this model): lm_head.dense.weight" in line and "pooler" not in line


def test_a_template_of_main_weight_boxes_is_read_too(tmp_path):
    """With 16-bit weights the optimizer's fp32 main copies make each template entry a list of
    boxes (``optimizer_load_template``): the shapes are read from them alike."""
    stored = {"model.classifier.weight": ShardedTensor("model.classifier.weight", torch.ones(3, 4), (3, 4), (0, 0))}
    save(stored, str(tmp_path), 1, {"iteration": 1})
    boxes = [ShardedTensor("model.classifier.weight", torch.zeros(1, 4), (2, 4), (row, 0)) for row in range(2)]
    template = {"model.classifier.weight": boxes, "model.pooler.dense.weight": [sharded("pooler.dense.weight", (4, 4))]}
    leave_fresh_heads(template, [TwoLabelModel()], str(tmp_path), 1)
    assert template == {}
