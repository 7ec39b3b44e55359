"""Megatron's ``--check-for-nan-in-loss-and-grad`` (on by default, as in Megatron-LM; turned off by
``--no-check-for-nan-in-loss-and-grad``): the rank(s) whose own loss or gradients went NaN/Inf are named
in one line each (rank, host, iteration, loss or grad), and the stop message after
``--max-nan-iterations`` NaN steps in a row, true for the precision in use.

A non-finite step is skipped on every rank and counted (Megatron's ``number of nan iterations``)
whatever the flag: the global gradient norm and loss are non-finite on every rank alike. Megatron
with the check on raises an error at the first NaN; gptrain skips, counts and names the rank, and
stops after ``--max-nan-iterations`` in a row. With the check on, each rank keeps on the device the
first iteration of the log interval at which its own loss, or its own gradients before the
data-parallel reduction (after the backward, or in the overlapped reduction's buckets; not under ZeRO,
whose reduce-scatter FSDP2 runs inside the backward), were non-finite: no
collective, no host-device sync; each rank reads its own once per log interval (the counters are
read there anyway) and prints its own line, with its host.
"""
from __future__ import annotations

import os
import socket

import torch

NAN_ENV = "GPTRAIN_NAN_AT"  # tests: "RANK@ITERATION[,RANK@ITERATION...]" -> that rank's loss is NaN there


def injected_iterations(rank: int) -> set[int]:
    """The iterations at which ``GPTRAIN_NAN_AT`` makes this rank's loss NaN (tests only)."""
    found = set()
    for item in filter(None, os.environ.get(NAN_ENV, "").split(",")):
        r, _, it = item.partition("@")
        if int(r) == rank:
            found.add(int(it))
    return found


class NanCheck:
    def __init__(self, enabled: bool, rank: int, device: torch.device):
        self.enabled, self.rank = enabled, rank
        self.inject = injected_iterations(rank)
        # the first iteration of the log interval at which this rank's loss ([0]) or gradients ([1])
        # were non-finite; 0: none
        self.first = torch.zeros(2, device=device) if enabled else None

    def maybe_inject(self, loss: torch.Tensor, iteration: int) -> torch.Tensor:
        return loss * float("nan") if iteration in self.inject else loss

    def record(self, loss: torch.Tensor, grads: list[torch.Tensor] | None, iteration: int,
               grads_nonfinite: torch.Tensor | None = None) -> None:
        """This rank's own ``loss`` and ``grads`` (before any reduction; None where they are reduced
        already, or where non-finite gradients are the fp16 loss scaler's business), or the flag the
        overlapped reduction's buckets noted before reducing; device-side only."""
        if not self.enabled:
            return
        flags = (~torch.isfinite(loss.float())).reshape(1)
        if grads:
            norm = torch.stack(torch._foreach_norm(grads)).float().sum()
            flags = torch.cat([flags, (~torch.isfinite(norm)).reshape(1)])
        elif grads_nonfinite is not None:
            flags = torch.cat([flags, grads_nonfinite.reshape(1)])
        else:
            flags = torch.cat([flags, torch.zeros_like(flags)])
        self.first = torch.where(flags & (self.first == 0), float(iteration), self.first)

    def report(self) -> None:
        """Once per log interval, on every rank: this rank prints its own line (its host is known here)."""
        if not self.enabled:
            return
        first = self.first.tolist()
        self.first.zero_()
        loss_at, grad_at = int(first[0]), int(first[1])
        if not (loss_at or grad_at):
            return
        what = " and ".join(w for w, at in (("loss", loss_at), ("grad", grad_at)) if at)
        at = min(a for a in (loss_at, grad_at) if a)
        print(f"NaN check: rank {self.rank}, host {socket.gethostname()}, iteration {at}: non-finite {what} "
              f"on this rank; the iteration's update was skipped on every rank and counted as a nan iteration",
              flush=True)


def stop_advice(precision, loss_scale: float | None) -> str:
    """What to try after too many NaN iterations in a row, for the precision in use."""
    if precision.fp16:
        scaling = f"dynamic loss scaling (scale now {loss_scale:g})" if precision.loss_scale is None \
            else f"a static --loss-scale {precision.loss_scale:g} (try a lower one, or leave it out for dynamic scaling)"
        return (f"fp16 with {scaling}: overflowing gradients alone are skipped by the scaler, so these are NaN "
                "losses. Lower --lr, check the data, or use --bf16 (fp32's range) instead of --fp16.")
    if precision.bf16:
        return ("bf16 has fp32's range, so this is not an overflow of the precision: lower --lr, set or lower "
                "--clip-grad, check the data (token ids within the vocabulary).")
    return ("the run is fp32 already, so the precision is not the cause: lower --lr, set or lower --clip-grad, "
            "check the data (token ids within the vocabulary).")
