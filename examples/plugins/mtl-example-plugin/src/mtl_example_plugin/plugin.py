"""The plugin: one hook implementation registering the 'eager' backend."""

from dataclasses import replace

from mtl.core.hookspecs import hookimpl
from mtl.parallel.backend_plugin import LOCAL_BACKEND

from mtl_example_plugin.attention import EagerAttention


@hookimpl
def mtl_backends():
    # Reuse the local backend's tensor-parallel linears and norms; swap one leaf.
    return [replace(LOCAL_BACKEND, name="eager", core_attention=EagerAttention,
                    description="local linears and norms, explicit softmax attention")]
