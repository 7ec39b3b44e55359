"""--optimizer-offload-fraction: which FSDP2 units keep their fp32 parameters, gradients and AdamW state in host
memory (FSDP2's CPUOffloadPolicy) and which keep them on the GPU, where their update takes milliseconds.

Megatron-LM's hybrid-device optimizer offloads parameters one by one, the first ones first, until the fraction is
reached. gptrain offloads whole FSDP2 units (a block, or the root with the embeddings and the output layer), the
last ones first: the host updates its blocks in the order the next forward needs them
(train/host_optimizer_step.py), so the blocks kept on the GPU, the first, run their forward while the host is still
updating the rest. The root is offloaded only with everything else (fraction 1), its output layer being the largest
single unit of a GPT-2-shaped model and the first the forward needs.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from gptrain.parallel.collectives import local


def offloaded_count(sizes: Sequence[int], fraction: float) -> int:
    """How many units, counted from the last, are offloaded: ``sizes`` are the units' parameter counts in the
    order the forward runs them, the first being the root's; units are taken from the last block back while the
    offloaded parameters are below ``fraction`` of all of them, and the root only at 1."""
    if fraction >= 1.0:
        return len(sizes)
    total, offloaded, count = sum(sizes), 0, 0
    for size in reversed(sizes[1:]):
        if offloaded >= fraction * total:
            break
        offloaded += size
        count += 1
    return count


def offloaded_modules(roots: Sequence[nn.Module], blocks: Sequence[nn.Module], fraction: float) -> set[nn.Module]:
    """The FSDP2 units to offload: of ``roots`` (the module holding the embeddings and the output layer, or a
    pipeline stage's chunks) and ``blocks`` (parallel/parallelize.apply_fsdp's units), by their parameter counts
    (train/build.py asks on the full-shape model, before tensor parallelism, as the planner counts them; a
    pipeline stage picks among its own blocks, where the planner takes the whole model's share)."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    own = [sum(local(p).numel() for p in root.parameters() if id(p) not in in_blocks) for root in roots]
    sizes = [sum(own), *(sum(local(p).numel() for p in block.parameters()) for block in blocks)]
    count = offloaded_count(sizes, fraction)
    units = [list(roots), *([block] for block in blocks)]
    return {module for unit in units[len(units) - count:] for module in unit}
