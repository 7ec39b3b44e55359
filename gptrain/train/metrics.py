"""What training reports: Megatron's log lines character for character, throughput (tokens/s per
device, TFLOP/s, MFU), the memory line, and TensorBoard scalars."""
from __future__ import annotations

import math
import os

import torch

# dense bf16/fp16 tensor-core peaks from the datasheets, TFLOP/s
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "A10": 125.0, "V100": 125.0, "4090": 165.0}


def device_peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def iteration_line(iteration: int, train_iters: int, consumed: int, ms_per_iter: float, lr: float, gbs: int,
                   loss: float | None, loss_scale: float, grad_norm: float | None, skipped: int, nans: int,
                   throughput: float | None = None, params_norm: float | None = None) -> str:
    """Megatron's line; ``throughput`` (TFLOP/s per GPU, --log-throughput) and ``params_norm``
    (--log-params-norm) add Megatron's fields where its training_log puts them."""
    s = f" iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed:12d} |"
    s += f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
    if throughput is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    s += f" learning rate: {lr:.3E} |"
    s += f" global batch size: {gbs:5d} |"
    if loss is not None:
        s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nans:3d} |"
    return s


def throughput_suffix(tokens_per_s: float, tflops: float, peak: float | None, eta_s: float | None,
                      device_type: str = "cuda", exit_limit: float | None = None) -> str:
    """Tokens/s, and on a GPU TFLOP/s and MFU (on a CPU they would read 0.0 and mean nothing); the ETA,
    with ``exit_limit`` where --exit-duration-in-mins (that many minutes) ends the run first."""
    s = f" tokens per GPU per second: {tokens_per_s:.0f} |"
    if device_type != "cpu":
        s += f" TFLOP/s per GPU: {tflops:.1f} |"
        if peak:
            s += f" MFU: {100.0 * tflops / peak:.1f}% |"
    if eta_s is not None:
        h, rem = divmod(int(eta_s), 3600)
        limit = f" (--exit-duration-in-mins {exit_limit:g})" if exit_limit else ""
        s += f" ETA: {h}:{rem // 60:02d}:{rem % 60:02d}{limit} |"
    return s


def validation_block(where: str, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    bar = "-" * (len(line) + 1)
    return f"{bar}\n{line}\n{bar}"


def memory_line(iteration: int, device: torch.device) -> str | None:
    """Megatron's memory line; in a distributed run each figure is the maximum over the ranks
    (every rank must call this)."""
    if device.type != "cuda":
        return None
    mb = 1024 * 1024
    values = torch.tensor([torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                           torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)],
                          dtype=torch.float64, device=device) / mb
    who = "[Rank 0]"
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        who = f"[max over {torch.distributed.get_world_size()} ranks]"
    allocated, max_allocated, reserved, max_reserved = values.tolist()
    return (f"{who} (after {iteration} iterations) memory (MB) | allocated: {allocated} | "
            f"max allocated: {max_allocated} | reserved: {reserved} | max reserved: {max_reserved}")


def host_memory_line() -> str:
    """This process's peak resident host memory (--cpu-offload keeps the optimizer state there)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB on Linux
    return f" > host memory (--cpu-offload): peak resident {peak:.2f} GiB on rank 0"


def wandb_run(cfg, rank: int):
    """``--wandb-project``: a wandb run on rank 0 (Megatron's arguments: the project, --wandb-exp-name as
    its name, --wandb-save-dir or --save/wandb as its folder, the run config), else None. The start-up
    checks (train/startup.py) refused the flag already where wandb is not installed."""
    t = cfg.train
    if not t.wandb_project or rank != 0:
        return None
    import wandb

    save_dir = t.wandb_save_dir or (os.path.join(t.save, "wandb") if t.save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=t.wandb_project, name=t.wandb_exp_name, dir=save_dir, config=cfg.to_dict())


class TensorBoard:
    """Scalars vs iteration and vs consumed samples, Megatron's tag names; written by one rank; to a
    wandb run too (``wandb_run``), by iteration, as Megatron's wandb writer logs them."""

    def __init__(self, log_dir: str | None, rank: int = 0, wandb_run=None):
        self.writer, self.wandb = None, wandb_run
        if log_dir and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, values: dict[str, float], iteration: int, samples: int) -> None:
        if self.wandb is not None:
            self.wandb.log({tag: value for tag, value in values.items() if value is not None}, step=iteration)
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is None:
                continue
            self.writer.add_scalar(tag, value, iteration)
            self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
