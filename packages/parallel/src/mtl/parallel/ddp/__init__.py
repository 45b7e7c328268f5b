"""Data parallelism: contiguous gradient buffers, buckets, overlapped reduction."""

from mtl.parallel.ddp.data_parallel import DataParallel
from mtl.parallel.ddp.grad_buffer import Bucket, GradBuffer, ParamSlot, accumulated_grad
from mtl.parallel.ddp.reduce_group import ReduceGroup, is_expert_param

__all__ = ["Bucket", "DataParallel", "GradBuffer", "ParamSlot", "ReduceGroup", "accumulated_grad", "is_expert_param"]
