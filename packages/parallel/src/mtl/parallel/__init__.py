"""mtl.parallel: process-group topology, tensor/sequence/pipeline/data/context parallel
primitives, and the ``local`` backend."""

__version__ = "0.1.0"
