"""Ending a process group after CUDA graphs: NCCL hangs destroying a communicator whose collectives a
live CUDA graph captured (pytorch issue 115388), so the graphs go first. inductor keeps the graphs of
``--compile-mode reduce-overhead`` (the default for tensor parallelism on GPUs) in its CUDA-graph trees,
not on the model; the decode loops keep theirs on the model (inference/host_loop.py)."""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist


def release_compiled_graphs() -> None:
    """inductor's captured CUDA graphs freed now (their next call would capture again)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    torch.cuda.synchronize()
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    gc.collect()


def end_process_group() -> None:
    """Destroy the default process group (a simulated world's too), CUDA graphs released first."""
    if dist.is_available() and dist.is_initialized():
        release_compiled_graphs()
        from gptrain.parallel.copy_engine import release_tp_exchanges
        from gptrain.parallel.peer_swap import release_swaps

        release_tp_exchanges()  # their names may come back with the next group
        release_swaps()
        dist.destroy_process_group()
