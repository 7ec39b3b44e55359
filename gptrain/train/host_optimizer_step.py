"""--cpu-offload with --overlap-cpu-optimizer-d2h-h2d: the host's AdamW step runs on a worker thread
block by block, in the order the next forward needs the blocks, so the next iteration's forward starts
as soon as the first block is updated and the step's host work overlaps the forward's copies and
compute (ZeRO-Offload++'s overlap of the CPU optimizer with the next step's GPU work).

What cannot overlap, and why: the step starts only after the whole backward, because the gradient
clipping factor and the non-finite check need the norm of every gradient; the next forward of a block
waits for that block's update (its pre-forward hook, run before FSDP2 copies the block's parameters to
the GPU). Everything that reads the parameters or the optimizer state outside a forward (the next
step, checkpoints, evaluation's hooks aside, the parameter norm) joins the worker first.

With --optimizer-offload-fraction the modules whose state stayed on the GPU are updated on the main thread at
launch, their kernels queued on the GPU before the next forward's; the thread takes the others.

The update is torch's fused AdamW kernel, the optimizer's own, over the optimizer's own state and
hyperparameters, so the numbers, the step counts and the checkpoints are those of the ordinary step. The
thread calls it on the parameters' local tensors: through DTensor, the kernel runs inside DTensor's Python
dispatch, which holds the GIL for the whole update and so stops the main thread, and with it the forward
this step is meant to overlap, for each block's update (benchmarks/RESULTS.md, the offload section).
One thread serves the run (the one measured); it holds the step weakly and ends when the step is collected
or closed, so the optimizer's host state is not kept alive by it.
"""
from __future__ import annotations

import queue
import threading
import weakref

import torch
import torch.nn as nn

from gptrain.train.checkpoint import init_optimizer_state
from gptrain.train.fused_step import FusedStep


class OverlappedHostStep:
    """Runs ``optimizer``'s step on a worker thread over ``blocks`` (module, its parameters) in order;
    each module's forward waits for its own update. ``launch`` after the backward, ``join`` before
    anything else reads the parameters or the state."""

    def __init__(self, optimizer: torch.optim.Optimizer, blocks: list[tuple[nn.Module, list[torch.Tensor]]],
                 device: torch.device | None = None):
        self.optimizer = optimizer
        self.device = device  # the rank's GPU: a new thread's current device is GPU 0, whatever the rank's
        covered = {id(p) for _, ps in blocks for p in ps}
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in covered]
        if missing:
            raise ValueError(f"the overlapped host step covers every parameter: {len(missing)} left out")
        self.steps = [FusedStep(optimizer, {id(p) for p in ps}) for _, ps in blocks]
        # the kernel updates the state in place: it exists from here on, as fused AdamW's first step makes it
        # (train/build.py makes it already; this is for optimizers made elsewhere, the tests')
        init_optimizer_state({str(i): p for i, p in enumerate(p for _, ps in blocks for p in ps)}, optimizer)
        self.done = [threading.Event() for _ in blocks]
        for e in self.done:
            e.set()
        self.idle = threading.Event()  # no step in flight
        self.idle.set()
        self.work: queue.SimpleQueue = queue.SimpleQueue()  # (grad_scale, found_inf) per step; None ends the thread
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.hooks = [module.register_forward_pre_hook(self._waiter(i), prepend=True)
                      for i, (module, _) in enumerate(blocks)]

    def _waiter(self, i: int):
        @torch._dynamo.disable
        def wait_for_update(module, args):
            if not self.done[i].is_set():
                self.done[i].wait()
            if self.error is not None:
                self.join()  # raises it
        return wait_for_update

    def launch(self) -> None:
        """Start the step (the optimizer's lr, grad_scale and found_inf as the caller set them): the modules kept
        on the GPU (--optimizer-offload-fraction) are updated here, their kernels queued before the next forward's,
        the others on the thread."""
        self.join()
        grad_scale = getattr(self.optimizer, "grad_scale", None)
        found_inf = getattr(self.optimizer, "found_inf", None)
        for step in self.steps:
            if not step.on_host:
                step.step(grad_scale, found_inf)
        for step, e in zip(self.steps, self.done):
            if step.on_host:
                e.clear()
        self.idle.clear()
        if self.thread is None:
            self.thread = threading.Thread(target=_serve, args=(weakref.ref(self), self.work),
                                           name="gptrain-host-adamw", daemon=True)
            weakref.finalize(self, self.work.put, None)  # the thread ends with this object
            self.thread.start()
        self.work.put((grad_scale, found_inf))

    def _run(self, grad_scale, found_inf) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # else the step's stream checks open a context on GPU 0
            for step, done in zip(self.steps, self.done):
                if step.on_host:
                    step.step(grad_scale, found_inf)
                    done.set()
        except BaseException as e:  # noqa: BLE001 (handed to the main thread by join)
            self.error = e
        finally:
            for done in self.done:
                done.set()
            self.idle.set()

    def join(self) -> None:
        """Wait for the step in flight, if any; raise what it raised."""
        self.idle.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("the host's optimizer step failed") from error

    def close(self) -> None:
        try:
            self.join()
        finally:
            for h in self.hooks:
                h.remove()
            if self.thread is not None:
                self.work.put(None)
                self.thread.join()
                self.thread = None


def _serve(host_ref: weakref.ref, work: queue.SimpleQueue) -> None:
    """The worker's loop: each step on the host step it is given, holding it only while a step runs."""
    while (item := work.get()) is not None:
        host = host_ref()
        if host is None:
            return
        host._run(*item)
        del host


def block_order(train_module: nn.Module, model, params: dict[str, torch.Tensor]) -> list[tuple[nn.Module, list]]:
    """The parameters by the module whose forward needs them first: the root (embeddings, final
    LayerNorm, output layer: its forward starts the step) and then each block in order."""
    blocks = [(block, list(block.parameters())) for block in model.layers.values()]
    in_blocks = {id(p) for _, ps in blocks for p in ps}
    root = [p for p in params.values() if id(p) not in in_blocks]
    return [(train_module, root)] + blocks
