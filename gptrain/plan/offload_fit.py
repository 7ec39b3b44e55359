"""How large a model fits with --cpu-offload: the most layers of the flags' width, sequence and batch whose
GPU peak fits the GPU (the planner's memory, with the allocator's slack) and whose host state (16 bytes a
parameter, offload_host_gib, for every rank on the node) fits the host's memory with room for the rest of
the process (HOST_USABLE)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from gptrain.config import RunConfig
from gptrain.plan.hardware import Gpu
from gptrain.plan.memory import offload_host_gib
from gptrain.plan.search import predict
from gptrain.train.build import parallel_dims

# of the host's memory, what the offloaded state may take: the rest is the process's own (the dataset's
# index, pinned staging, the Python heap) and the system's; the s18 6.7B ran with its 107 GB state on a
# 125 GiB host
HOST_USABLE = 0.9
MAX_LAYERS = 4096


def host_memory_gib() -> float | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class OffloadFit:
    layers: int
    parameters: int
    gpu_gib: float  # the GPU peak at that size
    host_gib: float  # the host state of the node's ranks at that size

    def describe(self, cfg: RunConfig, gpu: Gpu, host_total: float) -> str:
        return (f"largest with --cpu-offload at this width: {self.layers} layers x {cfg.model.hidden_size} "
                f"({self.parameters / 1e9:.2f} B parameters): GPU {self.gpu_gib:.1f} of {gpu.memory_gib:.0f} GiB, "
                f"host state {self.host_gib:.0f} of {host_total:.0f} GiB (the state may take {HOST_USABLE:.0%})")


def _with_layers(cfg: RunConfig, layers: int) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))


def _fits(cfg: RunConfig, world: int, gpu: Gpu, gpus_per_node: int, host_total: float):
    """(fits, the size's figures) or None where the layout refuses this many layers."""
    try:
        p = predict(cfg, world, gpu, gpus_per_node)
    except ValueError:
        return None
    ranks_here = min(world, gpus_per_node)
    host = offload_host_gib(cfg, parallel_dims(cfg, world)) * ranks_here
    fit = OffloadFit(cfg.model.num_layers, cfg.model.num_parameters(), p.peak_gib, host)
    return p.fits and host <= HOST_USABLE * host_total, fit


def largest_offload_model(cfg: RunConfig, world: int, gpu: Gpu, gpus_per_node: int,
                          host_total: float) -> OffloadFit | None:
    """The most layers (the flags' other settings kept) that fit the GPU and the host with --cpu-offload,
    None if no layer count does. Memory grows with the layers, so a bisection finds it; a count the layout
    refuses (a pipeline's stages, virtual stages, an uneven first or last stage) is replaced by the nearest
    smaller count it takes, within one round of the layout's granularity."""
    window = 2 * cfg.parallel.pipeline_parallel * max(1, cfg.parallel.layers_per_virtual_stage or 1)

    def probe(layers: int):
        for n in range(layers, max(layers - window, 0), -1):
            got = _fits(_with_layers(cfg, n), world, gpu, gpus_per_node, host_total)
            if got is not None:
                return got
        return None

    lo, hi, best = 0, MAX_LAYERS, None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = probe(mid)
        if got is not None and got[0]:  # it, or the counts the layout takes below it, fit
            lo, best = mid, got[1]
        else:
            hi = mid - 1
    return best


def least_offload_fraction(cfg: RunConfig, world: int, gpu: Gpu, gpus_per_node: int) -> tuple[float, float] | None:
    """The smallest --optimizer-offload-fraction whose GPU peak fits (the planner's memory): one that offloads the
    fewest last blocks (parallel/offload_split.py), or 1 with the root too; with its peak GiB. None if not even
    whole offload fits. Each fraction is half a block past the last whole block it needs, so a rounded print of
    it offloads the same blocks."""
    from gptrain.plan.memory import unit_sizes

    sizes = unit_sizes(cfg)
    for fraction in [(k - 0.5) * sizes[-1] / sum(sizes) for k in range(1, len(sizes))] + [1.0]:
        trial = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, offload_fraction=fraction))
        try:
            p = predict(trial, world, gpu, gpus_per_node)
        except ValueError:
            return None
        if p.fits:
            return fraction, p.peak_gib
    return None
