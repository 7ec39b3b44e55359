"""What a GPU process's first generation waits for, started beside the checkpoint read instead of
after it: the CUDA context, Triton's import and the cache key it computes once a process (a hash of
its own compiled library), and the decode kernels' definitions. Reading the weights and hashing
release the interpreter lock, so the two overlap; the main thread joins this one before it uses the
GPU for anything but the load."""
from __future__ import annotations

import threading

import torch


def start(device: torch.device) -> threading.Thread | None:
    """The work above on a thread of its own (None elsewhere than CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    thread = threading.Thread(target=_prepare, args=(torch.device(device),), name="gptrain-early-init", daemon=True)
    thread.start()
    return thread


def _prepare(device: torch.device) -> None:
    try:
        torch.zeros(1, device=device)  # the CUDA context
        from gptrain.kernels import decode, decode_io

        decode.define_kernels()
        decode_io.define_kernels()
        try:  # where Triton keeps it moved between versions
            from triton.runtime.cache import triton_key
        except ImportError:
            from triton.compiler.compiler import triton_key
        triton_key()  # cached for the process: the kernels' first launches need it
    except Exception:  # noqa: BLE001 - only a head start: the main thread meets any real problem itself
        pass
