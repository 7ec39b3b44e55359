"""cuBLASLt matmuls, autotuned per shape and with fused epilogues, through ctypes on the library
PyTorch already loaded.

Two things PyTorch does not give on CUDA: (1) a choice among cuBLASLt's algorithms (torch takes
the heuristic's first, and TunableOp tunes only on ROCm): on H100/H200 the fastest of the
heuristic's top 8 runs the 345M model's GEMMs up to ~10% faster; (2) the epilogues training
needs: GELU_AUX_BIAS (write GELU's input beside its output, for the backward), DGELU (multiply by
GELU's derivative) and BGRADB (reduce a bias gradient inside the weight-gradient GEMM).
TransformerEngine's fused MLP is built on these; ctypes needs no compiler on the user's machine,
only the libcublasLt that CUDA PyTorch ships.

``gemm`` speaks row-major: out (m x n) = op(a) (m x k) @ op(b) (k x n). cuBLASLt is column-major,
where a row-major matrix is its own transpose, so it computes out^T = op(b)^T @ op(a)^T: cuBLAS's
A is our b, its B our a, and an epilogue's bias vector runs along out's columns (n).
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
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # bytes of cuBLAS's A, B, C, D pointers (the heuristic assumes 256)
EPILOGUE_DEFAULT = 1
EPILOGUE_BIAS = 4  # out += bias (n)
EPILOGUE_GELU_AUX_BIAS = 164  # aux = out + bias; out = gelu_tanh(aux)
EPILOGUE_DGELU = 192  # out *= gelu_tanh'(aux)
EPILOGUE_DGELU_BGRAD = 208  # as DGELU, and bias = out.sum(0)
EPILOGUE_BGRADB = 512  # bias (m) = op(a).sum(1): a weight-gradient GEMM's bias gradient
_AUX_EPILOGUES = (EPILOGUE_GELU_AUX_BIAS, EPILOGUE_DGELU, EPILOGUE_DGELU_BGRAD)
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}
_WORKSPACE_BYTES = 32 * 1024 * 1024
_CANDIDATES = 8  # algorithms asked of the heuristic, timed once per shape (see CublasLt._autotune)
_TUNING_LAUNCHES = 10


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
        "cublasLtMatmulPreferenceDestroy": [vp],
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


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides the tensor's address."""
    ptr = t.data_ptr()
    return min(256, ptr & -ptr) if ptr else 256


@dataclass
class _Plan:
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # cuBLAS's A, B, D
    candidates: list[_HeuristicResult]
    chosen: _HeuristicResult | None = None
    times: list[float] | None = None  # ms per launch of each candidate, when autotuned


class CublasLt:
    """One handle and one workspace per device, and matmul plans cached by shape and epilogue."""

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
        self._workspace_ptr = self.workspace.data_ptr()
        self._plans: dict[tuple, _Plan] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._pointer = ctypes.c_void_p()  # reused to pass bias/aux pointers as attributes
        self.autotune = True

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status}")

    def _set(self, desc, attr: int, value) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    f"MatmulDescSetAttribute({attr})")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "LayoutCreate")
        return layout

    def _preference(self, alignments: tuple[int, int, int]) -> ctypes.c_void_p:
        """Workspace size and the operands' actual pointer alignment (ours: a, b, out)."""
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        align_a, align_b, align_out = alignments
        cublas_order = (align_b, align_a, align_out, align_out)  # cuBLAS's A is our b (module docstring)
        values = [(_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_WORKSPACE_BYTES))] + [
            (attr, ctypes.c_uint32(v)) for attr, v in zip(_PREF_MIN_ALIGNMENT, cublas_order)]
        for attr, value in values:
            self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value),
                                                                      ctypes.sizeof(value)), "PreferenceSet")
        return pref

    def _plan(self, key: tuple) -> _Plan:
        epilogue, dtype, m, n, k, trans_a, trans_b, alignments = key
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "DescCreate")
        # cuBLAS's A is our b, its B our a (see the module docstring)
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(_OP_T if trans_b else _OP_N))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(_OP_T if trans_a else _OP_N))
        self._set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue in _AUX_EPILOGUES:
            self._set(desc, _DESC_AUX_LD, ctypes.c_int64(n))
        layout_a = self._layout(dtype, k, n, k) if trans_b else self._layout(dtype, n, k, n)
        layout_b = self._layout(dtype, m, k, m) if trans_a else self._layout(dtype, k, m, k)
        layout_d = self._layout(dtype, n, m, n)
        results, count = (_HeuristicResult * _CANDIDATES)(), ctypes.c_int(0)
        pref = self._preference(alignments)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layout_a, layout_b, layout_d, layout_d,
                                                         pref, _CANDIDATES, results, ctypes.byref(count))
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        self._check(status, "GetHeuristic")
        candidates = [results[i] for i in range(count.value) if results[i].state == 0]
        if not candidates:
            raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at m={m} n={n} k={k}")
        plan = _Plan(desc, (layout_a, layout_b, layout_d), candidates)
        self._plans[key] = plan
        return plan

    def _launch(self, plan: _Plan, algo: _HeuristicResult, a_ptr: int, b_ptr: int, out_ptr: int, stream: int) -> None:
        la, lb, ld = plan.layouts
        self._check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.byref(self._one), b_ptr, la, a_ptr, lb, ctypes.byref(self._zero),
            out_ptr, ld, out_ptr, ld, ctypes.byref(algo.algo), self._workspace_ptr, _WORKSPACE_BYTES, stream), "Matmul")

    def _autotune(self, plan: _Plan, *operands) -> None:
        """Time each candidate the heuristic offered on the real operands. The heuristic's first
        choice stays unless another is clearly (2%) faster: short timings of large GEMMs are noisy
        (clocks move with power draw)."""
        times = []
        for algo in plan.candidates:
            for _ in range(2):
                self._launch(plan, algo, *operands)  # warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(_TUNING_LAUNCHES):
                self._launch(plan, algo, *operands)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / _TUNING_LAUNCHES)
        plan.times = times
        best = min(range(len(times)), key=times.__getitem__)
        plan.chosen = plan.candidates[best if times[best] < 0.98 * times[0] else 0]

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, trans_a: bool = False,
             trans_b: bool = False, epilogue: int = EPILOGUE_DEFAULT, bias: torch.Tensor | None = None,
             aux: torch.Tensor | None = None) -> torch.Tensor:
        """``out = epilogue(op(a) @ op(b))``, op = transpose where asked; contiguous row-major operands.

        bias is added (BIAS, GELU_AUX_BIAS: n) or written (DGELU_BGRAD: out.sum(0), n; BGRADB:
        op(a).sum(1), m); aux (m x n) is written (GELU_AUX_BIAS) or read (DGELU*).
        """
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        n = b.shape[0] if trans_b else b.shape[1]
        key = (epilogue, _DTYPES[a.dtype], m, n, k, trans_a, trans_b, (_alignment(a), _alignment(b), _alignment(out)))
        plan = self._plans.get(key) or self._plan(key)
        if bias is not None:
            self._pointer.value = bias.data_ptr()
            self._set(plan.desc, _DESC_BIAS_POINTER, self._pointer)
        if aux is not None:
            self._pointer.value = aux.data_ptr()
            self._set(plan.desc, _DESC_AUX_POINTER, self._pointer)
        operands = (a.data_ptr(), b.data_ptr(), out.data_ptr(), torch._C._cuda_getCurrentRawStream(a.device.index))
        if plan.chosen is None:
            if self.autotune and not torch.cuda.is_current_stream_capturing():
                self._autotune(plan, *operands)
            else:
                plan.chosen = plan.candidates[0]
        self._launch(plan, plan.chosen, *operands)
        return out


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
