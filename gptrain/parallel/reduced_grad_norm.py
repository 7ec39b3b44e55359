"""The gradients' squared norm summed on the GPU while FSDP2 reduces them, before --cpu-offload copies them to
the host.

Clipping and the non-finite check need the norm of every gradient. With offload the gradients are in host
memory by the end of the backward, and a norm over them is a CPU pass over every gradient: a pass slower than
the host's AdamW itself (torch's CPU norm kernel; benchmarks/RESULTS.md, ZeRO-Offload). FSDP2 calls its
all-reduce hook on each group's reduced gradients (one flat fp32 buffer) while they are still on the GPU, on
the stream that then copies them out. The hook adds the buffer's squared norm to a scalar on the GPU, so the
step reads one number and the host never reads the gradients for the norm.

It holds only where this rank's buffers are exactly its share of the norm: one data-parallel mesh of FSDP2
shards (no tensor parallelism, whose replicated parameters would count once per rank, and no pipeline, whose
tied embedding counts on one stage only). The buffers' padding is zeros.
"""
from __future__ import annotations

import torch
from torch import nn

from gptrain.parallel.dims import ParallelDims


def sums_on_device(dims: ParallelDims) -> bool:
    """Whether the layout's offloaded step takes its gradient norm here (train/build.py) rather than over the
    host's copies (what the planner counts, plan/search.py)."""
    return dims.cpu_offload and dims.tp == 1 and dims.pp == 1


class ReducedGradSquares:
    """Sums the squared L2 norm of every gradient FSDP2 reduces on this rank; ``take()`` returns the sum so far
    (a device scalar) and starts the next step's at zero."""

    def __init__(self, fsdp_modules: list[nn.Module], device: torch.device):
        self._squares = torch.zeros((), device=device, dtype=torch.float32)
        self._reduced = 0  # groups reduced since the last take(): a step that reduced none has no norm here
        for module in fsdp_modules:
            module.set_all_reduce_hook(self._add)

    def _add(self, reduced: torch.Tensor) -> None:
        # On the hook's stream, before the copy to the host that FSDP2 then queues on the same stream. With a
        # hook that stream is not the one the buffer was allocated on, and FSDP2 drops the buffer once the copy
        # is queued: recorded here, the allocator hands its memory to the next group's reduction only after
        # the copy has read it.
        if reduced.is_cuda:
            reduced.record_stream(torch.cuda.current_stream(reduced.device))
        self._squares.add_(torch.linalg.vector_norm(reduced, dtype=torch.float32).square())
        self._reduced += 1

    def take(self) -> torch.Tensor:
        """The squared norm of this rank's reduced gradients since the last call (read on the current stream:
        FSDP2's end of the backward has made it wait for the reductions)."""
        if self._reduced == 0:
            raise RuntimeError("no gradients were reduced since the last step")
        squares = self._squares.clone()
        self._squares.zero_()
        self._reduced = 0
        return squares
