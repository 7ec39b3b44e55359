"""Async tensor parallelism (``--tp-comm-overlap``): inductor's micro-pipeline pass rewrites each
sequence-parallel all-gather followed by a matmul, and each matmul followed by a reduce-scatter,
into symmetric-memory kernels that split the collective into per-rank chunks and overlap them with
the matmul's parts (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter).

The pass only matches bare matmuls (not ``addmm``), so the column-parallel layers add their bias
after the matmul when this is on (parallel/tensor_parallel.py), and the linear layers run on torch's
matmuls rather than the cuBLASLt ops, which the pass cannot see into.
"""
from __future__ import annotations

import warnings

import torch


def check_async_tp(tp: int, sequence_parallel: bool, compiled: bool, device: torch.device,
                   simulated: bool = False, compile_mode: str | None = None) -> None:
    """The conditions under which the rewrite can happen, refused with the missing one."""
    if tp == 1:
        raise ValueError("--tp-comm-overlap needs --tensor-model-parallel-size above 1")
    if not sequence_parallel:
        raise ValueError("--tp-comm-overlap needs --sequence-parallel (it overlaps the sequence-parallel "
                         "all-gathers and reduce-scatters with the matmuls)")
    if not compiled:
        raise ValueError("--tp-comm-overlap needs --compile (the overlap is a torch.compile rewrite)")
    if compile_mode in ("reduce-overhead", "max-autotune"):
        # the symmetric-memory kernels leave buffers in the graph pool that inductor's CUDA graphs refuse
        raise ValueError(f"--tp-comm-overlap does not run under CUDA graphs (--compile-mode {compile_mode}): "
                         "leave out one of the two")
    if device.type != "cuda" or not torch.distributed.is_nccl_available():
        raise ValueError(f"--tp-comm-overlap needs NVIDIA GPUs with NCCL (symmetric memory); this run is on "
                         f"{device.type}")
    if simulated:
        raise ValueError("--tp-comm-overlap cannot run in the rank simulator: symmetric memory needs the other "
                         "ranks' GPUs")


def enable_async_tp(group: torch.distributed.ProcessGroup) -> None:
    """Turn the rewrite on for the graphs compiled from now on, over ``group``."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    inductor_config._micro_pipeline_tp = True
    # torch 2.11 needs the group registered; later versions register it themselves and warn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
