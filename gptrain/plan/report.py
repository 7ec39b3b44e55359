"""The planner's one line in ``gptrain train``: the prediction in a dry run, and after the first
logged interval of a GPU run the measured tokens/s and peak memory beside it."""
from __future__ import annotations

import torch

from gptrain.config import RunConfig
from gptrain.plan.hardware import GPUS, load_gpu
from gptrain.plan.search import Prediction, predict

GIB = 1024 ** 3


def local_gpu(device: torch.device) -> str | None:
    """This process's GPU as the planner names it (None on a CPU or an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((g for g in GPUS if g.upper() in name), None)


def prediction(cfg: RunConfig, world: int, gpu: str, gpus_per_node: int = 8) -> Prediction | None:
    try:
        return predict(cfg, world, load_gpu(gpu), gpus_per_node)
    except ValueError:  # a layout the run itself refuses reports that, not the planner
        return None


def dry_run_line(cfg: RunConfig, world: int) -> str | None:
    gpu = local_gpu(torch.device("cuda")) if torch.cuda.is_available() else None
    where = gpu or "h100"
    p = prediction(cfg, world, where)
    if p is None:
        return None
    note = "" if gpu else " (no GPU here: `gptrain plan --gpu ... --evaluate` for another)"
    from gptrain.plan.memory import offload_host_gib
    from gptrain.train.build import parallel_dims

    host = offload_host_gib(cfg, parallel_dims(cfg, world))
    offload = f", {host:.2f} GiB of host memory per rank (--cpu-offload)" if host else ""
    if host:
        from gptrain.plan.offload_fit import host_memory_gib, largest_offload_model

        total = host_memory_gib()
        # 8 GPUs a node, as `gptrain plan`'s default --gpus-per-node: the ranks sharing one host's memory
        gpu_table = load_gpu(where)
        fit = largest_offload_model(cfg, world, gpu_table, 8, total) if total else None
        offload += f"; {fit.describe(cfg, gpu_table, total)} on this machine's host memory" if fit else ""
    return (f" > plan on {world} x {where}{note}: {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"{100 * p.mfu:.1f}% MFU, {p.step_s * 1000:.1f} ms per iteration, peak {p.peak_gib:.2f} GiB per GPU"
            f"{'' if p.fits else ' (does not fit)'}{offload}")


def measured_line(cfg: RunConfig, world: int, device: torch.device, tokens_per_s: float) -> str | None:
    gpu = local_gpu(device)
    p = prediction(cfg, world, gpu) if gpu else None
    if p is None:
        return None
    peak = torch.cuda.max_memory_allocated(device) / GIB
    return (f" > plan vs measured ({gpu}): tokens/s per GPU {p.tokens_per_s_per_gpu:,.0f} predicted, "
            f"{tokens_per_s:,.0f} measured ({tokens_per_s / p.tokens_per_s_per_gpu - 1:+.1%}); peak memory "
            f"{p.peak_gib:.2f} GiB predicted, {peak:.2f} measured ({peak / p.peak_gib - 1:+.1%})")
