"""--cpu-offload with --overlap-cpu-optimizer-d2h-h2d: the host's AdamW step runs on a worker thread
block by block, in the order the next forward needs the blocks, so the next iteration's forward starts
as soon as the first block is updated and the step's host work overlaps the forward's copies and
compute (ZeRO-Offload++'s overlap of the CPU optimizer with the next step's GPU work).

What cannot overlap, and why: the step starts only after the whole backward, because the gradient
clipping factor and the non-finite check need the norm of every gradient; the next forward of a block
waits for that block's update (its pre-forward hook, run before FSDP2 copies the block's parameters to
the GPU). Everything that reads the parameters or the optimizer state outside a forward (the next
step, checkpoints, evaluation's hooks aside, the parameter norm) joins the worker first.

The update itself is torch's fused AdamW on the same state as the one optimizer (sub-optimizers over
each block's parameters share its ``state`` and copy its hyperparameters each step), so the numbers,
the step counts and the checkpoints are those of the ordinary step.
"""
from __future__ import annotations

import threading

import torch
import torch.nn as nn

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                    "differentiable", "fused", "decoupled_weight_decay")


class _BlockStep:
    """The optimizer's step over one module's parameters: one sub-optimizer whose groups are the
    parts of the optimizer's groups that hold them."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: set[int]):
        self.optimizer = optimizer
        wholes, parts = [], []
        for group in optimizer.param_groups:
            mine = [p for p in group["params"] if id(p) in params]
            if mine:
                wholes.append(group)
                parts.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
        self.sub = type(optimizer)(parts, fused=optimizer.defaults.get("fused"))
        self.pairs = list(zip(wholes, self.sub.param_groups))  # (the optimizer's group, this block's part)
        self.params = [p for part in parts for p in part["params"]]

    def step(self, grad_scale, found_inf) -> None:
        for whole, part in self.pairs:
            for key in _HYPERPARAMETERS:
                if key in whole:
                    part[key] = whole[key]
        self.sub.state = self.optimizer.state  # shared (a checkpoint load may have replaced the dict)
        self.sub.grad_scale, self.sub.found_inf = grad_scale, found_inf
        self.sub.step()
        for p in self.params:
            p.grad = None


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
        self.steps = [_BlockStep(optimizer, {id(p) for p in ps}) for _, ps in blocks]
        self.done = [threading.Event() for _ in blocks]
        for e in self.done:
            e.set()
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
        """Start the step (the optimizer's lr, grad_scale and found_inf as the caller set them)."""
        self.join()
        grad_scale = getattr(self.optimizer, "grad_scale", None)
        found_inf = getattr(self.optimizer, "found_inf", None)
        for e in self.done:
            e.clear()
        self.thread = threading.Thread(target=self._run, args=(grad_scale, found_inf), name="gptrain-host-adamw",
                                       daemon=True)
        self.thread.start()

    def _run(self, grad_scale, found_inf) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # else the step's stream checks open a context on GPU 0
        try:
            for step, done in zip(self.steps, self.done):
                step.step(grad_scale, found_inf)
                done.set()
        except BaseException as e:  # noqa: BLE001 (handed to the main thread by join)
            self.error = e
        finally:
            for done in self.done:
                done.set()

    def join(self) -> None:
        """Wait for the step in flight, if any; raise what it raised."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("the host's optimizer step failed") from error

    def close(self) -> None:
        self.join()
        for h in self.hooks:
            h.remove()


def block_order(train_module: nn.Module, model, params: dict[str, torch.Tensor]) -> list[tuple[nn.Module, list]]:
    """The parameters by the module whose forward needs them first: the root (embeddings, final
    LayerNorm, output layer: its forward starts the step) and then each block in order."""
    blocks = [(block, list(block.parameters())) for block in model.layers.values()]
    in_blocks = {id(p) for _, ps in blocks for p in ps}
    root = [p for p in params.values() if id(p) not in in_blocks]
    return [(train_module, root)] + blocks
