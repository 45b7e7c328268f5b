"""The plugin: one hook implementation registering the ``parallel_gpt`` model family."""

from mtl.core.hookspecs import hookimpl
from mtl.models.gpt.family import gpt_like_family

from mtl_example_family.parallel_layer import parallel_layer_spec

# GPTModel's embedding, stack, head and loss with this layer; the same GEMMs as gpt's layer,
# so gpt's FLOP count (the default of gpt_like_family) holds.
PARALLEL_GPT = gpt_like_family(
    "parallel_gpt",
    parallel_layer_spec,
    description="GPT-J style: attention and MLP in parallel from one input norm",
)


@hookimpl
def mtl_model_families():
    return [PARALLEL_GPT]
