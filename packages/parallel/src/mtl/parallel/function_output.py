"""What a custom ``autograd.Function``'s forward returns when it filled that tensor in place, or
got it back as is from an op (``_c10d_functional.wait_tensor`` returns its input).

torch 2.11's ``torch.compile`` (the GPU machines' release) traces such a forward with each
intermediate as an extra output of the traced forward; a tensor filled in place (the result of
an in-place collective, a buffer written piece by piece) or passed through then appears there
twice, once as the returned tensor and once as the op's result, and autograd gives the gradient
to one of the two and zeros to the other: the layers before the Function train on a zero
gradient from it (fixed in torch 2.13; benchmarks/log, fifteenth session). A view is a
tensor of its own, so nothing appears twice. ``packages/train/tests/test_function_outputs.py`` checks every mtl
Function's outputs in the layouts that call them.
"""

from __future__ import annotations

import torch


def fresh_output(filled: torch.Tensor) -> torch.Tensor:
    """``filled`` as a new view (no copy), for a Function to return instead of ``filled``."""
    return filled.view_as(filled)
