"""How the trainer feeds a ``bert`` micro-batch to the model and reduces what it returns.

The batch carries Megatron-Core's ``BERTMaskedWordPieceDataset`` fields: ``text``, ``types``,
``labels`` (-1 where nothing is predicted), ``is_random``, ``padding_mask`` (1: a real token),
``loss_mask``. The loss is Megatron's: the mean MLM loss over the micro-batch's masked tokens,
plus the mean binary (NSP / sentence-order) loss over its samples when the head exists.

Under context parallelism each rank holds part of every sample, and its share of the masked
tokens differs; the trainer averages the ranks' losses, so each rank divides its sum by the
micro-batch's count over the whole cp group (times cp), and the binary loss, read from the
first token, counts on the rank holding it (cp rank 0) only.

A sequence-classification batch (``data.dataset = 'classification'``, ``model.num_labels``)
carries ``text``, ``types``, ``padding_mask`` and one ``label`` per sample; its loss is the mean
cross-entropy over the micro-batch's samples, reported with the share classified right.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.core.errors import ConfigError


FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask")


def encoder_forward_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's forward keywords from one micro-batch (a ConfigError, before the first
    forward, for samples of another dataset)."""
    if "label" in batch:  # the classification dataset's samples
        return {"input_ids": batch["text"], "position_ids": batch["position_ids"], "token_type_ids": batch["types"],
                "padding_mask": batch["padding_mask"], "sequence_labels": batch["label"]}
    missing = [name for name in FIELDS if name not in batch]
    if missing:
        raise ConfigError(
            f"model.family = 'bert' reads the bert dataset's fields, and the samples lack {', '.join(missing)} "
            f"(they have {', '.join(sorted(batch))}); set data.dataset = 'bert'"
        )
    return {
        "input_ids": batch["text"],
        "position_ids": batch["position_ids"],
        "labels": batch["labels"],
        "token_type_ids": batch["types"],
        "padding_mask": batch["padding_mask"],
        "binary_labels": batch["is_random"],
    }


def encoder_loss(output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], topology
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro-batch's loss, its metrics: loss, mlm_loss, mlm_accuracy and binary_loss; or
    for sequence classification loss and accuracy)."""
    if "sequence_loss" in output:
        loss = output["sequence_loss"].mean()
        return loss, {"loss": loss.detach(), "accuracy": output["sequence_hits"].mean()}
    mask = batch["loss_mask"].float()
    cp = topology.cp if topology is not None else 1
    with torch.no_grad():
        counts = torch.stack([mask.sum(), (output["mlm_hits"] * mask).sum()])
        if cp > 1:
            dist.all_reduce(counts, group=topology.group("cp"))
    masked_tokens = counts[0].clamp(min=1.0)
    mlm_loss = (output["mlm_loss"].float() * mask).sum() * cp / masked_tokens
    loss = mlm_loss
    metrics = {"mlm_loss": mlm_loss.detach(), "mlm_accuracy": counts[1] / masked_tokens}
    if "binary_loss" in output:
        holds_first_token = cp == 1 or topology.cp_rank == 0
        binary_loss = output["binary_loss"].float().mean() * (cp if holds_first_token else 0)
        loss = loss + binary_loss
        metrics["binary_loss"] = binary_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
