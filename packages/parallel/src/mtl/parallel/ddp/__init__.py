"""Data parallelism: contiguous gradient buffers, buckets, overlapped reduction."""

from mtl.parallel.ddp.data_parallel import DataParallel
from mtl.parallel.ddp.grad_buffer import Bucket, GradBuffer, ParamSlot, accumulated_grad

__all__ = ["Bucket", "DataParallel", "GradBuffer", "ParamSlot", "accumulated_grad"]
