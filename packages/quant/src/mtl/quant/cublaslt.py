"""An FP8 GEMM that adds its product into an fp32 tensor: cuBLASLt, called through ctypes.

Why: the weight-gradient GEMM of an FP8 linear (``dW = dyᵀ x``) should land in the fp32
``main_grad`` buffer, summed over micro-batches. ``torch._scaled_mm`` (torch 2.11 to 2.13)
always writes a new tensor, so without this the gradient is written in bf16 and a second
kernel adds it into ``main_grad``: on the reference model 47 ms of a 0.95 s FP8 step on an
H100, 1,168 launches (benchmarks/log). cuBLASLt itself computes
``D = alpha * op(A) op(B) + beta * C``; with ``C = D = out`` and ``beta = 1`` the sum happens
in the GEMM's epilogue, in fp32, and the bf16 gradient never exists. Transformer Engine does
the same through its own cuBLASLt call.

How: the ``libcublasLt`` that torch's CUDA build has already loaded, through ctypes, so
nothing is compiled and no CUDA toolkit is needed. The enum values are cuBLASLt's public ABI
(``cublasLt.h``, unchanged from CUDA 11.8 to 13). A plan (descriptors and the heuristic's
algorithm) is built once per shape, dtype pair and pointer alignment and kept; a call sets
the two scale pointers and launches on torch's current stream with a workspace this module
owns (one per stream), so it may be captured in a CUDA graph. ``accepts`` says which operands
it takes; ``scaled_matmul`` adds the product itself for the others.

Only per-tensor scales: Hopper's cuBLASLt has no per-row scaling (torch's row-wise FP8 is a
CUTLASS kernel), so row-wise operands take ``scaled_matmul``'s add path.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

# cudaDataType_t, cublasComputeType_t, cublasOperation_t (library_types.h, cublas_api.h)
_CUDA_R_32F = 0
_FP8_TYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # of A, B, C, D
_MAX_ALIGNMENT = 256  # what cuBLASLt assumes when told nothing
_MIN_ALIGNMENT = 16  # bytes: every pointer of an FP8 GEMM
CUDA_MULTIPLE = 16  # every dimension of one (cuBLASLt's rule, so torch._scaled_mm's too)
_STATUS_NOT_SUPPORTED = 15  # cublasStatus_t

WORKSPACE_BYTES = 32 * 1024 * 1024  # NVIDIA's recommendation for Hopper


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned an error status (named with the call)."""


class _NoAlgorithm(CublasLtError):
    """The heuristic found no algorithm for these shapes and alignments (not a failure: the
    caller takes another path)."""


def _library_path() -> str | None:
    """The libcublasLt torch has mapped into this process (torch's CUDA build links it)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:  # no /proc (not Linux): the caller tries the library's usual name
        return None
    return None


_lib = None
_lib_lock = threading.Lock()


def _library() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            torch.cuda.init()  # loads torch's CUDA libraries, cuBLASLt among them
            path = _library_path() or (f"libcublasLt.so.{torch.version.cuda.split('.')[0]}"
                                       if torch.version.cuda else None)
            if path is None:
                raise CublasLtError("this torch has no CUDA build, so no cuBLASLt to call")
            lib = ctypes.CDLL(path)
            p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
            signatures = {
                "cublasLtCreate": [p],
                "cublasLtMatmulDescCreate": [p, i, i],
                "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
                "cublasLtMatrixLayoutCreate": [p, i, u64, u64, i64],
                "cublasLtMatmulPreferenceCreate": [p],
                "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
                "cublasLtMatmulPreferenceDestroy": [p],
                "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, p, p],
                "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, sz, p],
            }
            for name, args in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            _lib = lib
        return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt {what} failed with status {status}")


def _alignment(t: torch.Tensor) -> int:
    ptr = t.data_ptr()
    return min(_MAX_ALIGNMENT, ptr & -ptr) if ptr else _MAX_ALIGNMENT


class _Plan:
    """Descriptors and algorithm of ``out [n, m] += (a [n, k] * sa) @ (b [m, k] * sb)ᵀ``,
    all row-major. cuBLASLt is column-major: it sees ``outᵀ [m, n] = op(A) op(B)`` with
    ``A`` = b's memory (``[k, m]`` column-major, transposed: the "TN" layout Hopper's FP8
    GEMMs require) and ``B`` = a's memory (``[k, n]`` column-major)."""

    def __init__(self, lib, handle, n: int, m: int, k: int, a_type: int, b_type: int, fast_accum: bool,
                 alignments: tuple[int, int, int, int]):
        self.lib, self.handle = lib, handle
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        self._set(_DESC_TRANSA, ctypes.c_int(_OP_T))
        self._set(_DESC_TRANSB, ctypes.c_int(_OP_N))
        self._set(_DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
        self.layouts = []
        for dtype, rows, cols in ((b_type, k, m), (a_type, k, n), (_CUDA_R_32F, m, n), (_CUDA_R_32F, m, n)):
            layout = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows), "MatrixLayoutCreate")
            self.layouts.append(layout)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        workspace = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(workspace),
                                                        ctypes.sizeof(workspace)), "MatmulPreferenceSetAttribute")
        for attribute, alignment in zip(_PREF_MIN_ALIGNMENT_BYTES, alignments):
            value = ctypes.c_uint32(alignment)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attribute, ctypes.byref(value), ctypes.sizeof(value)),
                   "MatmulPreferenceSetAttribute")
        result, found = _HeuristicResult(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, *self.layouts, pref, 1, ctypes.byref(result),
                                                    ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(pref)  # only the heuristic reads it
        if status == _STATUS_NOT_SUPPORTED or (status == 0 and found.value < 1):
            raise _NoAlgorithm(f"cuBLASLt has no FP8 algorithm for out [{n}, {m}] += a [{n}, {k}] @ b [{m}, {k}]ᵀ")
        _check(status, "MatmulAlgoGetHeuristic")
        self.algo = result.algo
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0)

    def _set(self, attribute: int, value) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value),
                                                        ctypes.sizeof(value)), "MatmulDescSetAttribute")

    def run(self, out, a, a_scale, b, b_scale, workspace, stream: int) -> None:
        self._set(_DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data_ptr()))
        self._set(_DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data_ptr()))
        layout_a, layout_b, layout_c, layout_d = self.layouts
        out_ptr = out.data_ptr()
        _check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), b.data_ptr(), layout_a,
                                       a.data_ptr(), layout_b, ctypes.byref(self.beta), out_ptr, layout_c, out_ptr,
                                       layout_d, ctypes.byref(self.algo), workspace.data_ptr(), WORKSPACE_BYTES,
                                       stream), "Matmul")


# One launch at a time: a plan's descriptor carries the call's scale pointers from
# ``_Plan.run``'s first line to its launch. (mtl calls this from one autograd thread per device.)
_lock = threading.Lock()
_handles: dict[int, ctypes.c_void_p] = {}  # device index -> cuBLASLt handle
_workspaces: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream): concurrent streams must not share one
_plans: dict[tuple, _Plan | None] = {}  # None: cuBLASLt has no algorithm for that key


def accepts(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> bool:
    """Whether ``fp8_gemm_accumulate`` takes these operands: CUDA, ``out`` fp32, ``a`` and ``b``
    FP8, all three contiguous, 16-byte aligned, every dimension a multiple of 16, and both
    scales fp32 scalars on the device (cuBLASLt reads them through device pointers)."""
    tensors = (out, a, b)
    return (out.is_cuda and out.dtype == torch.float32 and a.dtype in _FP8_TYPES and b.dtype in _FP8_TYPES
            and all(s.dim() == 0 and s.dtype == torch.float32 and s.device == out.device for s in (a_scale, b_scale))
            and all(t.is_contiguous() and _alignment(t) >= _MIN_ALIGNMENT for t in tensors)
            and not any(d % CUDA_MULTIPLE for d in (*a.shape, b.shape[0])))


def _workspace(index: int, stream: int) -> torch.Tensor:
    workspace = _workspaces.get((index, stream))
    if workspace is None:
        workspace = _workspaces[(index, stream)] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                               device=f"cuda:{index}")
    return workspace


def _handle(index: int) -> ctypes.c_void_p:
    handle = _handles.get(index)
    if handle is None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            _check(_library().cublasLtCreate(ctypes.byref(handle)), "Create")
        _handles[index] = handle
    return handle


def fp8_gemm_accumulate(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                        b_scale: torch.Tensor, fast_accum: bool = False) -> bool:
    """``out [n, m] += (a [n, k] * a_scale) @ (b [m, k] * b_scale)ᵀ`` for operands ``accepts``
    takes. The product is accumulated in fp32 (``fast_accum`` False: Hopper's exact mode, as
    Transformer Engine's weight-gradient GEMMs) and added to ``out`` by cuBLASLt. Returns
    False, having done nothing, where cuBLASLt has no algorithm for these shapes and alignments
    (the caller then adds the product itself)."""
    (n, k), m = a.shape, b.shape[0]
    index = out.device.index
    key = (index, n, m, k, a.dtype, b.dtype, fast_accum, _alignment(b), _alignment(a), _alignment(out))
    stream = torch._C._cuda_getCurrentRawStream(index)
    with _lock:
        handle = _handle(index)
        if key not in _plans:
            try:
                _plans[key] = _Plan(_library(), handle, n, m, k, _FP8_TYPES[a.dtype], _FP8_TYPES[b.dtype],
                                    fast_accum, key[-3:-1] + (key[-1], key[-1]))
            except _NoAlgorithm:
                _plans[key] = None
        plan = _plans[key]
        if plan is None:
            return False
        plan.run(out, a, a_scale, b, b_scale, _workspace(index, stream), stream)
    return True
