"""tokenizers, Megatron-compatible indexed datasets, preprocessing, GPT datasets"""

__version__ = "0.1.0"
