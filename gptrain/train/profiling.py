"""Megatron-LM's ``--profile`` window on the ranks of ``--profile-ranks`` (all by default): nsys's capture started
and stopped through the CUDA profiler API (``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop``),
which records iterations ``--profile-step-start`` + 1 to ``--profile-step-end``; or, with ``--use-pytorch-profiler``,
torch's profiler on Megatron's schedule, which records iterations ``--profile-step-start`` to
``--profile-step-end`` - 1, counted from the loop's start (a resumed run's first iteration is its 1), its Chrome
trace written to ``--tensorboard-dir/../torch_profile/rank-N.json.gz``. Both exactly as Megatron-LM does: the calls
come where its loop makes them, at the top of each iteration (``before_step``, with the iterations done so far) and
after it (``after_step``). A run ending inside the window leaves nsys's capture to end with the process.
"""
from __future__ import annotations

from pathlib import Path

import torch


class ProfileWindow:
    def __init__(self, train_cfg, rank: int):
        t = train_cfg
        self.start, self.end = t.profile_step_start, t.profile_step_end
        self.rank = rank
        self.torch_profiler = None
        if t.use_pytorch_profiler:
            trace_dir = Path(t.tensorboard_dir) / ".." / "torch_profile"

            def write(profiler) -> None:
                trace_dir.mkdir(parents=True, exist_ok=True)
                profiler.export_chrome_trace(str(trace_dir / f"rank-{rank}.json.gz"))

            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(self.start - 1, 0), warmup=1 if self.start > 0 else 0,
                                                 active=self.end - self.start, repeat=1),
                on_trace_ready=write, record_shapes=t.pytorch_profiler_collect_shapes,
                with_stack=t.pytorch_profiler_collect_callstack)

    @classmethod
    def of(cls, train_cfg, rank: int) -> "ProfileWindow | None":
        """The window for this rank, or None (no --profile, or a rank --profile-ranks leaves out)."""
        if not train_cfg.profile or (train_cfg.profile_ranks and rank not in train_cfg.profile_ranks):
            return None
        return cls(train_cfg, rank)

    def begin(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.start()

    def before_step(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def after_step(self, iteration: int) -> None:
        if iteration != self.end:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())

    def close(self) -> None:
        """A run that ends inside the window: the profiler stopped (its trace written so far)."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
