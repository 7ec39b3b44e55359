"""cuBLASLt matmuls with fused epilogues, called through ctypes on the library PyTorch already loaded.

PyTorch exposes cuBLASLt's bias and bias+GELU epilogues (``torch._addmm_activation``) but not the
two that training needs: GELU_AUX_BIAS (write GELU's input beside its output, for the backward)
and DGELU_BGRAD (multiply a matmul's result by GELU's derivative and reduce the bias gradient in
the same kernel). TransformerEngine's fused MLP is built on exactly these two; calling them through
ctypes needs no compiler on the user's machine, only the libcublasLt that CUDA PyTorch ships.

Row-major PyTorch matrices are column-major matrices transposed, so ``out = x @ w.T`` (x: M x K,
w: N x K, out: M x N) is the column-major ``out^T = w^T-op(w) @ x^T``: A = w (transposed), B = x.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

# cublasLt.h / library_types.h constants (stable across CUDA 11-13)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUE_BIAS = 4
EPILOGUE_GELU_AUX_BIAS = 164
EPILOGUE_DGELU_BGRAD = 208
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}
_WORKSPACE_BYTES = 32 * 1024 * 1024


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library_path(fragment: str) -> str | None:
    """Path of a shared library already mapped into this process (the one torch linked)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if fragment in path.rsplit("/", 1)[-1]:
                    return path
    except OSError:
        return None
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types, so 64-bit sizes and pointers are passed as such."""
    vp, p, i32, u32, u64, i64, sz = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                                     ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t)
    signatures = {
        "cublasLtCreate": [p],
        "cublasLtMatmulPreferenceCreate": [p],
        "cublasLtMatmulPreferenceSetAttribute": [vp, u32, vp, sz],
        "cublasLtMatmulDescCreate": [p, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, u32, vp, sz],
        "cublasLtMatrixLayoutCreate": [p, i32, u64, u64, i64],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, vp, vp],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@dataclass
class _Plan:
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    algo: _HeuristicResult


class CublasLt:
    """One handle, one workspace per device, and a cache of matmul plans keyed by shape and epilogue."""

    def __init__(self, device: torch.device):
        torch.cuda.init()  # maps libcublasLt into the process
        path = _loaded_library_path("libcublasLt.so")
        if path is None:
            raise RuntimeError("libcublasLt is not loaded by this PyTorch build")
        self.lib = _declare(ctypes.CDLL(path))
        self.device = device
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.preference = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.preference)), "PreferenceCreate")
        size = ctypes.c_uint64(_WORKSPACE_BYTES)
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
            self.preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size)), "PreferenceSet")
        self._plans: dict[tuple, _Plan] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status}")

    def _set(self, desc, attr: int, value) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    f"MatmulDescSetAttribute({attr})")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
        return layout

    def _plan(self, key: tuple) -> _Plan:
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        epilogue, dtype, m, n, k, trans_w = key
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "DescCreate")
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(_OP_T if trans_w else _OP_N))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue in (EPILOGUE_GELU_AUX_BIAS, EPILOGUE_DGELU_BGRAD):
            self._set(desc, _DESC_AUX_LD, ctypes.c_int64(n))
        # column-major: A is the weight (n x k after its op), B the activations (k x m), D is n x m
        a = self._layout(dtype, k, n, k) if trans_w else self._layout(dtype, n, k, n)
        b = self._layout(dtype, k, m, k)
        d = self._layout(dtype, n, m, n)
        result, count = _HeuristicResult(), ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, self.preference, 1,
                                                            ctypes.byref(result), ctypes.byref(count)), "GetHeuristic")
        if count.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at m={m} n={n} k={k}")
        plan = _Plan(desc, (a, b, d), result)
        self._plans[key] = plan
        return plan

    def matmul(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, epilogue: int, trans_w: bool,
               bias: torch.Tensor | None = None, aux: torch.Tensor | None = None) -> None:
        """``out = epilogue(x @ op(w))`` with op(w) = w.T (trans_w) or w; all row-major and contiguous.

        GELU_AUX_BIAS: out = gelu(x @ w.T + bias), aux = x @ w.T + bias.
        DGELU_BGRAD: out = (x @ w) * gelu'(aux), bias = out.sum(0).
        """
        m, k = x.shape
        n = w.shape[0] if trans_w else w.shape[1]
        plan = self._plan((epilogue, _DTYPES[x.dtype], m, n, k, trans_w))
        if bias is not None:
            self._set(plan.desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        if aux is not None:
            self._set(plan.desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
        a, b, d = plan.layouts
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        self._check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.byref(self._one), ctypes.c_void_p(w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self._zero), ctypes.c_void_p(out.data_ptr()), d,
            ctypes.c_void_p(out.data_ptr()), d, ctypes.byref(plan.algo.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(_WORKSPACE_BYTES), stream), "Matmul")


@functools.cache
def cublaslt(device_index: int) -> CublasLt:
    return CublasLt(torch.device("cuda", device_index))


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the cuBLASLt epilogues cannot run for this device and dtype (None: they can)."""
    if device.type != "cuda":
        return f"{device.type} device (cuBLASLt needs CUDA)"
    if dtype not in _DTYPES:
        return f"{dtype} parameters (the fused epilogues run in bf16/fp16)"
    if torch.version.hip is not None:
        return "ROCm build"
    try:
        cublaslt(device.index if device.index is not None else torch.cuda.current_device())
    except (RuntimeError, OSError, AttributeError) as err:
        return str(err)
    return None
