"""The ``gpt`` model family: GPT-2 and Llama style decoders built from one layer spec."""

from mtl.models.gpt.inference_context import InferenceContext
from mtl.models.gpt.layer_spec import layer_spec
from mtl.models.gpt.model import GPTModel, build_gpt

__all__ = ["GPTModel", "InferenceContext", "build_gpt", "layer_spec"]
