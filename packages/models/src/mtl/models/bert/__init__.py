"""The ``bert`` model family: BERT / RoBERTa encoders built from gpt's leaves."""

from mtl.models.bert.model import EncoderModel, build_encoder

__all__ = ["EncoderModel", "build_encoder"]
