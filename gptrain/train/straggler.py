"""``--log-straggler`` (Megatron's flag): which ranks are slow. Each rank times its own forward and
backward passes (CUDA events on a GPU, so no synchronisation in the step; the host clock on a CPU); at
each log interval one all-gather of those times lets rank 0 name the fastest and slowest ranks against
the median. Under layouts whose collectives sit inside the backward (ZeRO, --overlap-grad-reduce,
tensor and pipeline parallelism) a rank's time includes its waits, so a straggler shows as the one rank
that is *fast* (the others wait for it); with plain data parallelism the times are each rank's compute.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

THRESHOLD = 1.1  # the slowest rank this far above the median is called a straggler
SLOW_ENV = "GPTRAIN_SLOW_RANK"  # "RANK:SECONDS": that rank sleeps this long in each timed window (tests)


class StragglerLog:
    def __init__(self, device: torch.device, count: int = 1):
        self.device, self.count = device, max(1, count)
        self._spans: list[tuple] = []
        self._open = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        want = os.environ.get(SLOW_ENV, "")
        self._sleep = float(want.split(":")[1]) if want.startswith(f"{rank}:") else 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()
        if self._sleep:
            time.sleep(self._sleep)

    def stop(self) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._open, end))
        else:
            self._spans.append((self._open, time.perf_counter()))

    def _mean_ms(self) -> float:
        if not self._spans:
            return 0.0
        if self.device.type == "cuda":
            self._spans[-1][1].synchronize()
            total = sum(a.elapsed_time(b) for a, b in self._spans)
        else:
            total = 1000.0 * sum(b - a for a, b in self._spans)
        return total / len(self._spans)

    def line(self) -> str | None:
        """Every rank calls this at a log interval; rank 0 gets the line."""
        mine = torch.tensor([self._mean_ms()], dtype=torch.float64, device=self.device)
        self._spans = []
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return f" > straggler: forward-backward {mine.item():.1f} ms per iteration (one rank)"
        times = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(times, mine)
        if dist.get_rank() != 0:
            return None
        ms = [t.item() for t in times]
        order = sorted(range(len(ms)), key=ms.__getitem__)
        median = statistics.median(ms)
        fast = ", ".join(f"rank {r} {ms[r]:.1f}" for r in order[:self.count])
        slow = ", ".join(f"rank {r} {ms[r]:.1f}" for r in reversed(order[-self.count:]))
        ratio = ms[order[-1]] / median if median > 0 else 1.0
        verdict = f": rank {order[-1]} is a straggler" if ratio > THRESHOLD else ""
        return (f" > straggler: forward-backward ms per iteration over {len(ms)} ranks: fastest {fast} | median "
                f"{median:.1f} | slowest {slow} ({ratio:.2f}x the median){verdict}")
