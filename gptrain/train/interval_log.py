"""What the training loop reports every ``--log-interval`` iterations (train/loop.py's Trainer calls
``log_interval``): Megatron's iteration line with the fields its flags add (``--log-throughput``'s
throughput per GPU, ``--log-params-norm``'s params norm), gptrain's throughput suffix with an ETA that
honours ``--exit-duration-in-mins``, the memory line once, the TensorBoard / wandb scalars
(``--log-timers-to-tensorboard``: the iteration time too), the NaN check's lines, and the stop after too
many NaN steps (its advice for the precision in use)."""
from __future__ import annotations

import time

import torch

from gptrain.parallel.collectives import global_norm_and_sum, world_size
from gptrain.train import metrics
from gptrain.train.nan_check import stop_advice


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many NaN iterations); the message says why and what was saved."""


def params_norm(trainer) -> float:
    """Megatron's ``calc_params_l2_norm``: the L2 norm of every parameter the optimizer updates, over all
    ranks (shards once, replicas once, the tied output copy of a last pipeline stage left out). Every
    rank must call it."""
    dims, layout = trainer.parts.dims, trainer.parts.layout
    named = list(trainer.opt_params.items())
    pipeline = trainer.pipeline
    if pipeline is not None and pipeline.last and not pipeline.first:
        tied = trainer.opt_params.get("word_embeddings.weight")
        named = [(n, p) for n, p in named if p is not tied]
    norm, _ = global_norm_and_sum([p.detach() for _, p in named], torch.zeros((), device=trainer.device), dims.pp,
                                  [layout.is_split(n) for n, _ in named], dims.tp)
    return norm.item()


def eta_seconds(trainer, ms_per_iter: float) -> tuple[float, bool]:
    """Seconds until training ends: the remaining iterations at this pace, or sooner where
    ``--exit-duration-in-mins`` stops the run first (then True)."""
    t = trainer.cfg.train
    eta = (t.train_iters - trainer.iteration) * ms_per_iter / 1000.0
    if t.exit_duration_in_mins and trainer.run_start is not None:
        left = max(0.0, t.exit_duration_in_mins * 60.0 - (time.perf_counter() - trainer.run_start))
        if left < eta:
            return left, True
    return eta, False


def log_interval(trainer, stats) -> None:
    self = trainer
    t = self.cfg.train
    loss_sum, advanced, nan_count, nan_run, grad_norm = torch.stack(
        [self._loss_sum, self._advanced, self._nan_count, self._nan_run, self._grad_norm]).tolist()
    elapsed = time.perf_counter() - stats.start_time
    nans = int(round(nan_count))
    if self.scaler is None and nans:
        # give back the schedule steps of updates skipped on the device (Megatron never takes them)
        self.schedule.num_steps -= int(round(self._nan_samples.item()))
    skipped = stats.skipped + (nans if self.scaler is None else 0)
    avg_loss = loss_sum / advanced if advanced > 0 else None
    ms = 1000.0 * elapsed / stats.iterations
    # per GPU: the global batch's tokens over every rank of the layout (Megatron's figure)
    tokens_per_s = stats.samples * self.cfg.model.seq_length / elapsed / world_size()
    tflops = tokens_per_s * self.flops_per_token / 1e12
    eta, by_limit = eta_seconds(self, ms)
    if t.log_params_norm:
        self.settle()  # the weights of this iteration: wait for an optimizer step still on the host's thread
    norm = params_norm(self) if t.log_params_norm else None
    line = metrics.iteration_line(self.iteration, t.train_iters, self.consumed_train, ms, self.schedule.lr(),
                                  self.global_batch, avg_loss, self.loss_scale,
                                  grad_norm if advanced > 0 else None, skipped, nans,
                                  throughput=tflops if t.log_throughput else None, params_norm=norm)
    self.log(line + metrics.throughput_suffix(tokens_per_s, tflops, self.peak, eta, self.device.type,
                                              exit_limit=t.exit_duration_in_mins if by_limit else None))
    if self.straggler and (straggler := self.straggler.line()):
        self.log(straggler)
    if not self.memory_reported:
        mem = metrics.memory_line(self.iteration, self.device)
        if mem:
            self.log(mem)
        if self.parts.dims.cpu_offload:
            self.log(metrics.host_memory_line())
        self.memory_reported = True
    # the planner's prediction against the first interval without this process's first iteration (which
    # compiles and warms up)
    first_of_process = self.iteration - stats.iterations <= (self.loaded_iteration or 0)
    if not self.plan_reported and not first_of_process and self.device.type == "cuda":
        from gptrain.plan.report import measured_line

        plan = measured_line(self.cfg, world_size(), self.device, tokens_per_s)
        if plan:
            self.log(plan)
        self.plan_reported = True
    if avg_loss is not None:
        self.last_train_loss = avg_loss
        self.train_losses.append((self.iteration, avg_loss))
        if self.first_train_loss is None:
            self.first_train_loss = avg_loss
    scalars = {"learning-rate": self.schedule.lr(), "batch-size": self.global_batch, "lm loss": avg_loss,
               "loss-scale": self.loss_scale, "grad-norm": grad_norm if advanced > 0 else None,
               "params-norm": norm, "tokens-per-second-per-gpu": tokens_per_s, "tflops-per-gpu": tflops}
    if t.log_timers_to_tensorboard:  # Megatron's tags: seconds per iteration, and the throughput it logs
        scalars["iteration-time"] = ms / 1000.0
        if t.log_throughput:
            scalars["throughput"] = tflops
    self.tb.scalars(scalars, self.iteration, self.consumed_train)
    self.nan_check.report()  # --check-for-nan-in-loss-and-grad: a rank that produced a NaN names itself
    for counter in (self._loss_sum, self._advanced, self._nan_count, self._nan_samples):
        counter.zero_()
    if nan_run >= t.max_nan_iterations:
        self.save()
        self.checkpointer.close()
        saved = f"the last good state is saved in {t.save}" if t.save else "no --save was given, nothing saved"
        raise TrainingStopped(f"{int(nan_run)} NaN/inf iterations in a row at iteration {self.iteration} "
                              f"(--max-nan-iterations {t.max_nan_iterations}): stopping; {saved}. "
                              + stop_advice(self.cfg.precision, self.loss_scale if self.scaler else None))
