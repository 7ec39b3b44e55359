"""This rank's micro-batches for the training loop: Megatron's pretraining sampler over a dataset,
read ahead in a background thread, and the empty loader of a middle pipeline stage."""
from __future__ import annotations

import queue
import threading

import numpy as np
import torch


class MicroBatchLoader:
    """This rank's micro-batches from ``start`` (a sample index), assembled and pinned in a
    background thread so the copy to the device overlaps compute. Wraps around at the end.

    Megatron's pretraining sampler: each step of ``micro_batch_size x dp_size`` consecutive samples
    is cut into ``dp_size`` slices and rank r reads slice r, so a global batch holds the same
    samples in the same order at any data-parallel size."""

    def __init__(self, dataset, start: int, micro_batch_size: int, device: torch.device, prefetch: int = 4,
                 dp_rank: int = 0, dp_size: int = 1):
        self.dataset, self.position, self.mbs, self.device = dataset, start, micro_batch_size, device
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        position = self.position
        try:
            while not self._stop.is_set():
                n = len(self.dataset)
                first = position + self.dp_rank * self.mbs
                batch = np.stack([self.dataset[(first + k) % n] for k in range(self.mbs)])
                tensor = torch.from_numpy(batch)
                if self.pin:
                    tensor = tensor.pin_memory()
                position += self.mbs * self.dp_size
                while not self._stop.is_set():
                    try:
                        self._queue.put(tensor, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # surfaced in the training thread, never swallowed
            self._queue.put(err)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self.position += self.mbs * self.dp_size
        batch = item.to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def next_step(self, n_micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's micro-batches, concatenated (what a pipeline schedule splits again)."""
        pairs = [self.next() for _ in range(n_micro)]
        return torch.cat([t for t, _ in pairs]), torch.cat([lb for _, lb in pairs])


class NoData:
    """The loader of a middle pipeline stage, which reads no data (activations come from the previous stage)."""

    def next_step(self, n_micro: int):
        return None, None

    def close(self) -> None:
        pass
