"""The ``t5`` model family: T5 encoder-decoders from gpt's leaves and T5's own pieces."""

from mtl.models.t5.model import T5Model, T5Shape, build_t5

__all__ = ["T5Model", "T5Shape", "build_t5"]
