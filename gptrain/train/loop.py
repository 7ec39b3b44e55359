"""The training loop: Megatron's semantics (micro-batches, skipped and NaN iterations, lr schedule in
samples, evaluation, checkpoints) with as few host-device synchronisations as possible.

Sync policy: bf16 and fp32 steps never wait for the device. A non-finite gradient norm becomes a
``found_inf`` tensor that fused AdamW reads on the device to skip the update, and the counters
(loss sum, NaN iterations) stay on the device until the log interval reads them once. fp16 reads
the overflow flag every step, as Megatron does, because the loss scale must react to it.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from gptrain.config import RunConfig
from gptrain.data.loader import MicroBatchLoader, NoData
from gptrain.parallel.collectives import all_reduce_, global_norm_and_sum, local, world_size
from gptrain.parallel.data_parallel import average_flat, average_gradients
from gptrain.parallel.dims import is_logging_rank, world_from_env
from gptrain.train import metrics
from gptrain.train.manual_gc import ManualGC
from gptrain.train.profiling import ProfileWindow
from gptrain.train.startup import datetime_line
from gptrain.train.interval_log import TrainingStopped, log_interval  # noqa: F401 (re-exported)
from gptrain.train.build import TrainingParts
from gptrain.train.checkpoint import Checkpointer
from gptrain.train import heartbeat, restart_note, signals
from gptrain.train.checkpoint_files import iteration_dir
from gptrain.train.durable import stall_point
from gptrain.train.nan_check import NanCheck
from gptrain.train.trainer_load import CheckpointLoading
from gptrain.train.precision import LossScaler
from gptrain.train.schedule import LRSchedule
from gptrain.train.straggler import StragglerLog


@dataclass
class IntervalStats:
    iterations: int = 0
    samples: int = 0  # the interval's global batches summed (they grow under --rampup-batch-size)
    skipped: int = 0
    start_time: float = 0.0


@dataclass
class TrainProgress:
    """Where training stands. Its state sits at state.json's top level under Megatron's names; the
    iteration is the checkpointer's (it names the folder and is written into state.json by it)."""
    iteration: int = 0
    consumed_train: int = 0
    consumed_valid: int = 0

    def state_dict(self) -> dict:
        return {"consumed_train_samples": self.consumed_train, "consumed_valid_samples": self.consumed_valid}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"]) if state["iteration"] != "release" else 0
        self.consumed_train = int(state["consumed_train_samples"])
        self.consumed_valid = int(state["consumed_valid_samples"])


def _progress(name: str) -> property:
    return property(lambda self: getattr(self.progress, name), lambda self, v: setattr(self.progress, name, v))


class Trainer(CheckpointLoading):
    """Runs the loop over parts assembled by ``train/build.py`` (model, forward, optimizer, layout);
    resuming from a checkpoint folder is ``CheckpointLoading``'s (train/trainer_load.py)."""

    # the loop's counters live in self.progress, so that the checkpoint takes them from one place
    iteration, consumed_train, consumed_valid = map(_progress, ("iteration", "consumed_train", "consumed_valid"))

    def __init__(self, cfg: RunConfig, parts: TrainingParts, train_ds, valid_ds, test_ds, device: torch.device,
                 log=print):
        self.cfg, self.parts, self.device = cfg, parts, device
        self.log = log if is_logging_rank() else (lambda s: None)
        self.model, self.main, self.forward = parts.model, parts.main, parts.forward
        self.pipeline = parts.pipeline
        self.train_ds, self.valid_ds, self.test_ds = train_ds, valid_ds, test_ds
        self.dp_rank = parts.mesh["dp"].get_local_rank() if parts.mesh is not None else 0
        self.dp_size = parts.dims.dp
        self.fp8_layers = parts.fp8_layers
        self.linear_impl, self.attention_impl = parts.impls["linear layers"], parts.impls["attention"]
        self.opt_params = parts.opt_params
        self.optimizer = parts.optimizer
        self.host_step = parts.host_step  # --overlap-cpu-optimizer-d2h-h2d: the step in flight on a thread
        self.schedule = LRSchedule.from_config(cfg.optim, cfg.train)
        # --profile: the iterations profiled on this rank (train/profiling.py)
        self.profile = ProfileWindow.of(cfg.train, world_from_env()[1])
        # --manual-gc: the collector's points in the loop (train/manual_gc.py)
        self.manual_gc = ManualGC(cfg.train.manual_gc_interval, cfg.train.manual_gc_eval) if cfg.train.manual_gc \
            else None
        self.scaler = LossScaler.from_config(cfg.precision)
        self.progress = TrainProgress()
        self.loaded_iteration: int | None = None
        # the parts whose state_dict()s make state.json (progress's at its top level; without fp16 the
        # scaler is None and saved as null)
        self.stateful = {"progress": self.progress, "schedule": self.schedule, "scaler": self.scaler}
        p = cfg.precision
        # autocast only where the parameters stay fp32 (--autocast)
        self.compute_dtype = None if p.half_params else torch.bfloat16 if p.bf16 else torch.float16 if p.fp16 else None
        self.eod = cfg.data.eod_token if cfg.data.eod_mask_loss else None
        self.tb = metrics.TensorBoard(cfg.train.tensorboard_dir, rank=world_from_env()[1],  # rank 0 writes
                                      wandb_run=metrics.wandb_run(cfg, world_from_env()[1]))
        self.peak = metrics.device_peak_tflops(device, cfg.train.peak_tflops)
        self.flops_per_token = cfg.model.flops_per_token()
        self.params = list(self.opt_params.values())
        # device-side counters, read once per log interval
        zeros = lambda: torch.zeros((), device=device, dtype=torch.float32)  # noqa: E731
        self._loss_sum, self._advanced, self._nan_count, self._nan_run = zeros(), zeros(), zeros(), zeros()
        self._grad_norm = zeros()
        self._nan_samples = zeros()  # samples of the steps skipped on the device (the log gives them back)
        self.global_batch = cfg.train.global_batch_at(0)  # the last iteration's (the log line shows it)
        self.total_skipped = 0
        self.memory_reported = False
        self.plan_reported = False
        self.straggler = StragglerLog(device, cfg.train.straggler_minmax_count) if cfg.train.log_straggler else None
        self.last_train_loss: float | None = None
        self.first_train_loss: float | None = None
        # what the run's result reports (train/run.py's TrainResult): (iteration, lm loss) per logged
        # interval and per validation, the end-of-training test loss, why training stopped early
        self.train_losses: list[tuple[int, float]] = []
        self.validation_losses: list[tuple[int, float]] = []
        self.test_loss: float | None = None
        self.exit_reason: str | None = None
        self.checkpointer = Checkpointer(cfg.train.async_save, self.log)
        self.run_start: float | None = None  # when train() began (--exit-duration-in-mins counts from it)
        self.nan_check = NanCheck(cfg.train.check_for_nan_in_loss_and_grad, world_from_env()[1], device)
        if self.nan_check.enabled and self.scaler is None and parts.grad_buckets is not None:
            parts.grad_buckets.check_finite()  # the overlapped reduction's buckets, before they are reduced

    def loader(self, dataset, start: int) -> MicroBatchLoader | NoData:
        if self.pipeline is not None and not self.pipeline.needs_data:
            return NoData()
        return MicroBatchLoader(dataset, start, self.cfg.train.micro_batch_size, self.device,
                                dp_rank=self.dp_rank, dp_size=self.dp_size)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each rank: global batch / (micro-batch x data-parallel size)."""
        return self.cfg.train.micro_batches_per_step(self.dp_size)

    def _loss_mask(self, tokens: torch.Tensor) -> torch.Tensor | None:
        # Megatron's --eod-mask-loss: positions whose input is the end-of-document token do not count
        return None if self.eod is None else (tokens != self.eod).float()

    def _before_micro_batch(self, last: bool) -> None:
        """ZeRO-1 and ZeRO-2 keep the gathered parameters between micro-batches (gathered once per
        step); ZeRO-1 also keeps the gradients whole and reduce-scatters them once, after the last
        micro-batch (FSDP2 accumulates them in fp32 meanwhile), where ZeRO-2 reduce-scatters after
        each micro-batch and holds only shards. --cpu-offload accumulates as ZeRO-1 at every stage:
        a host copy and a CPU add per micro-batch would cost more than the micro-batch."""
        dims = self.parts.dims
        if not dims.sharded:
            return
        module = self.parts.train_module
        if dims.zero_stage < 3:
            module.set_reshard_after_backward(last)
        if dims.zero_stage == 1 or dims.cpu_offload:
            module.set_requires_gradient_sync(last)

    # ---- precision helpers
    def _autocast(self):
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    # ---- checkpoints
    def state(self) -> dict:
        saved = {name: part.state_dict() if part else None for name, part in self.stateful.items()}
        return {**saved.pop("progress"), **saved,
                "config": self.cfg.to_dict(), "layout": {"dp": self.dp_size, "tp": self.parts.dims.tp,
                                                         "pp": self.parts.dims.pp, "zero_stage": self.parts.dims.zero_stage}}

    def settle(self) -> None:
        """Wait for an optimizer step still running on the host (--overlap-cpu-optimizer-d2h-h2d), so the
        parameters and the optimizer state are this iteration's."""
        if self.host_step is not None:
            self.host_step.join()

    def mean_unlogged_loss(self) -> float:
        """The mean training loss of the steps taken since the last logged interval (every step, where none
        was logged: a benchmark's), the same on every rank; it waits for the device."""
        return (self._loss_sum / self._advanced.clamp(min=1)).item()

    def save(self) -> None:
        if not self.cfg.train.save:
            return
        self.settle()
        heartbeat.progress(self.iteration, "checkpoint save")
        self.checkpointer.save(self.cfg.train.save, self.iteration, self.opt_params, self.optimizer, self.state(),
                               self.cfg.model.vocab_size, self.parts.layout)

    # ---- one optimisation step
    def _forward_backward(self, loader: MicroBatchLoader, scale: float, n_micro: int) -> torch.Tensor:
        """This rank's share of the global batch (``n_micro`` micro-batches), forward and backward; returns
        the mean of the micro-batches' losses (zero on pipeline stages other than the last)."""
        if self.pipeline is not None:
            tokens, labels = loader.next_step(n_micro)
            mask = self._loss_mask(tokens) if self.pipeline.last else None
            return self.pipeline.train_step(tokens, labels, mask, scale, self.device, n_micro)
        loss_acc = torch.zeros((), device=self.device)
        buckets = self.parts.grad_buckets
        for i in range(n_micro):
            self._before_micro_batch(last=i == n_micro - 1)
            if buckets is not None:  # reduce during the last micro-batch's backward
                buckets.arm(i == n_micro - 1)
            tokens, labels = loader.next()
            with self._autocast():
                loss = self.forward(tokens, labels, self._loss_mask(tokens)) / n_micro
            if self.nan_check.inject:  # GPTRAIN_NAN_AT (tests)
                loss = self.nan_check.maybe_inject(loss, self.iteration + 1)
            (loss * scale if self.scaler else loss).backward()
            if self.main is not None and buckets is None:  # with buckets, hooks took each gradient
                self.main.accumulate_grads()
            loss_acc += loss.detach().float()
        return loss_acc

    def _tied_gradient(self) -> torch.Tensor | None:
        p = self.opt_params.get("word_embeddings.weight")
        return None if p is None else p.grad

    def train_step(self, loader: MicroBatchLoader, global_batch: int | None = None) -> bool | None:
        """Forward/backward over this rank's share of the global batch (``global_batch`` samples, default
        --global-batch-size) and one update. Returns, for fp16 only, whether the step was skipped
        (bf16/fp32 decide on the device and return None)."""
        scale = self.loss_scale
        gbs = global_batch or self.cfg.train.global_batch_size
        if self.parts.model.hashed_dropout:
            # the hashed dropout's counter follows the iteration, so a resumed run draws the masks
            # the straight run drew (each forward of the step advances it by one)
            self.parts.model.dropout_step.fill_(self.iteration << 16)
        n_micro = gbs // (self.cfg.train.micro_batch_size * self.dp_size)
        if self.straggler:
            self.straggler.start()
        loss_acc = self._forward_backward(loader, scale if self.scaler else 1.0, n_micro)
        if self.straggler:
            self.straggler.stop()
        self._empty_unused_memory(1)
        self.settle()
        lr = self.schedule.lr()
        o = self.cfg.optim
        for group in self.optimizer.param_groups:  # --decoupled-lr: the embeddings' and output layer's own
            group["lr"] = self.schedule.lr(o.decoupled_lr, o.decoupled_min_lr) if group.get("decoupled") else lr
        layout = self.parts.layout
        named = [(n, p.grad) for n, p in self.opt_params.items() if p.grad is not None]
        dims = self.parts.dims
        # --check-for-nan-in-loss-and-grad: this rank's own loss, and its gradients where they are not reduced
        # yet (with fp16, non-finite gradients are the loss scaler's business)
        buckets = self.parts.grad_buckets
        own = buckets is None and not dims.sharded and self.scaler is None
        if buckets is not None:  # reduced during the backward: the last buckets launched (each checked first), waited
            buckets.wait()
        bucket_flag = buckets.take_nonfinite() if buckets is not None else None
        rows = dims.distributed_optimizer  # self.main: a ShardedMainParams, its gradient whole until reduced
        own_grads = ([self.main.grad_flat] if rows else [local(g) for _, g in named]) if own else None
        self.nan_check.record(loss_acc, own_grads, self.iteration + 1, bucket_flag)
        if buckets is None and dims.replicated:  # data parallelism: average the whole gradients over the replicas
            group = self.parts.mesh["dp"].get_group()
            low = torch.bfloat16 if self.cfg.parallel.grad_reduce_in_bf16 else None
            if rows:  # each rank receives the average of its own rows
                self.main.reduce_scatter(low)
                named = [(n, p.grad) for n, p in self.opt_params.items()]
            elif self.main is not None:
                average_flat(self.main.grad_flat, group, dims.dp, low)
            else:
                average_gradients([g for _, g in named], group, dims.dp, low)
        # sequence parallelism's per-rank gradients summed over the tensor-parallel group, once the
        # data-parallel reduction (which may still be in flight with overlap) is done with them
        layout.reduce_sequence_parallel_grads(self.opt_params)
        if self.pipeline is not None:
            self.pipeline.sum_tied_gradients(self._tied_gradient())
            if self.pipeline.last and not self.pipeline.first:  # the tied copy counts once, on the first stage
                tied = self._tied_gradient()
                named = [(n, g) for n, g in named if g is not tied]
        if rows and dims.tp == 1:  # each rank's rows once
            grad_norm, loss_sum = global_norm_and_sum([], loss_acc, squares=self.main.grad_squares())
        elif self.main is not None and not rows and dims.tp == 1 and dims.pp == 1:  # whole, equal on every replica
            grad_norm, loss_sum = self.main.grad_norm(), all_reduce_(loss_acc.clone())
        elif self.parts.grad_squares is not None:  # --cpu-offload: summed on the GPU before the host copies
            grad_norm, loss_sum = global_norm_and_sum([], loss_acc, squares=self.parts.grad_squares.take())
        else:  # one all-reduce gives every rank the global gradient norm and the global batch's loss
            grad_norm, loss_sum = global_norm_and_sum([g for _, g in named], loss_acc, dims.pp,
                                                      [layout.is_split(n) for n, _ in named], dims.tp)
        loss_acc = loss_sum / (world_size() // dims.pp)  # the loss is summed where the last stage holds it
        if self.scaler is not None:
            # the norm of the scaled gradients is non-finite exactly when one of them is, on any rank
            found_inf = (~torch.isfinite(grad_norm)).float()
            loss_is_finite = math.isfinite(loss_acc.item())
            skipped = bool(found_inf.item()) or not loss_is_finite
            self.scaler.update(skipped)
            self._nan_run = self._nan_run * 0 if loss_is_finite else self._nan_run + 1
            if not skipped:
                grad_norm = grad_norm / scale
                # unscaling and clipping in one factor that fused AdamW divides the gradients by
                clip = torch.clamp((grad_norm + 1e-6) / self.cfg.optim.clip_grad, min=1.0) \
                    if self.cfg.optim.clip_grad > 0 else torch.ones((), device=self.device)
                self.optimizer.grad_scale = clip * scale
                self.optimizer.found_inf = None
                launched = self._optimizer_step()
                self.schedule.step(gbs)
                self._grad_norm = grad_norm.detach().float()
                self._loss_sum += loss_acc
                self._advanced += 1
            else:
                launched = False
                self._nan_count += float(not loss_is_finite)
            self._end_step(updated=not skipped, launched=launched)
            return skipped
        bad = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_acc)).float()
        # fused AdamW skips the update on the device when found_inf is set, and divides the gradients
        # by grad_scale: gradient clipping (Megatron's max_norm / (norm + 1e-6) when below 1) without
        # a separate pass over the gradients
        self.optimizer.found_inf = bad
        if self.cfg.optim.clip_grad > 0:
            self.optimizer.grad_scale = torch.clamp((grad_norm + 1e-6) / self.cfg.optim.clip_grad, min=1.0)
        launched = self._optimizer_step()
        self._end_step(updated=True, launched=launched)  # a device-side skip left the main weights as they were
        # the schedule advances now; the log interval takes back steps that turned out skipped
        self.schedule.step(gbs)
        good = 1.0 - bad
        self._loss_sum += torch.nan_to_num(loss_acc * good, nan=0.0, posinf=0.0, neginf=0.0)
        self._advanced += good
        self._nan_count += bad
        self._nan_samples += bad * gbs
        self._nan_run = (self._nan_run + bad) * bad
        self._grad_norm = torch.where(bad > 0, self._grad_norm, grad_norm.detach().float())
        return None

    def _optimizer_step(self) -> bool:
        """The update; returns whether it was launched on the host's thread (which drops the gradients)."""
        if self.parts.dims.cpu_offload:
            # fused AdamW moves these scalars to the host without waiting for the device that computes them
            for name in ("grad_scale", "found_inf"):
                value = getattr(self.optimizer, name, None)
                if value is not None:
                    setattr(self.optimizer, name, value.cpu())
        if self.host_step is not None:
            self.host_step.launch()
            return True
        if self.parts.local_step is not None:  # the distributed optimizer's rows, on their local tensors
            self.parts.local_step.step(getattr(self.optimizer, "grad_scale", None),
                                       getattr(self.optimizer, "found_inf", None))
            return False
        self.optimizer.step()
        return False

    def _end_step(self, updated: bool, launched: bool = False) -> None:
        """Drop the gradients (the host's thread drops them itself, block by block, once it has used them);
        with half-precision parameters, copy the updated main weights in."""
        # overlapped reduction keeps fp32 gradients as views of its buffer: zeroed, not dropped
        if not launched:
            self.optimizer.zero_grad(set_to_none=self.parts.grad_buckets is None or self.main is not None)
        if self.main is not None:
            self.main.release_grads()
            if updated:
                self.main.copy_to_model()
        self._empty_unused_memory(2)

    def _empty_unused_memory(self, level: int) -> None:
        """--empty-unused-memory-level: at this point of the step from ``level`` on (Megatron-LM's points)."""
        if self.cfg.train.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()  # nothing where CUDA was never initialised

    # ---- evaluation
    @torch.no_grad()
    def evaluate(self, dataset, consumed: int, iters: int) -> float:
        """Mean loss over ``iters`` global batches from ``consumed``, averaged over data-parallel ranks."""
        module = self.parts.train_module
        self.settle()
        module.eval()
        loader = self.loader(dataset, consumed)
        total = torch.zeros((), device=self.device)
        n = iters * self.num_micro_batches
        try:
            if self.pipeline is not None:
                for _ in range(iters):
                    tokens, labels = loader.next_step(self.num_micro_batches)
                    mask = self._loss_mask(tokens) if self.pipeline.last else None
                    total += self.pipeline.eval_step(tokens, labels, mask, self.device)
                    self._empty_unused_memory(1)
            else:
                for i in range(n):
                    tokens, labels = loader.next()
                    with self._autocast():
                        total += module(tokens, labels, self._loss_mask(tokens)).float()
                    if (i + 1) % self.num_micro_batches == 0:  # each evaluation batch, as Megatron-LM
                        self._empty_unused_memory(1)
        finally:
            loader.close()
            module.train()
        # every rank of the last stage holds the loss (summed here over data- and tensor-parallel ranks)
        return (all_reduce_(total) / (n * (world_size() // self.parts.dims.pp))).item()

    def _validate(self, where: str) -> None:
        t = self.cfg.train
        loss = self.evaluate(self.valid_ds, self.consumed_valid, t.eval_iters)
        self.consumed_valid += t.eval_iters * t.global_batch_size
        self.log(metrics.validation_block(where, loss))
        self.validation_losses.append((self.iteration, loss))
        self.tb.scalars({"lm loss validation": loss, "lm loss validation ppl": math.exp(min(20.0, loss))},
                        self.iteration, self.consumed_train)

    # ---- the loop
    def _log_interval(self, stats: IntervalStats) -> None:
        log_interval(self, stats)  # train/interval_log.py: the iteration line, its extra fields, the scalars

    def _out_of_time(self, run_start: float) -> bool:
        """--exit-duration-in-mins: every rank must stop at the same iteration, so with several
        processes the clocks are compared (the latest wins) once per log interval."""
        late = (time.perf_counter() - run_start) / 60.0 > self.cfg.train.exit_duration_in_mins
        if world_size() == 1:
            return late
        if self.iteration % self.cfg.train.log_interval:
            return False
        flag = torch.tensor(float(late), device=self.device)
        return bool(all_reduce_(flag, torch.distributed.ReduceOp.MAX).item())

    def train(self) -> None:
        t = self.cfg.train
        self.parts.train_module.train()
        loader = self.loader(self.train_ds, self.consumed_train)
        run_start = self.run_start = time.perf_counter()
        stats = IntervalStats(start_time=time.perf_counter())
        exit_reason = None
        self.global_batch = t.global_batch_at(self.consumed_train)  # where a resumed run's ramp-up stands
        try:
            if self.manual_gc is not None and not t.skip_train:
                self.manual_gc.start()
            if self.profile is not None and not t.skip_train:
                self.profile.begin()
            while self.iteration < t.train_iters and not t.skip_train:
                stall_point(world_from_env()[1], self.iteration + 1)
                if self.profile is not None:
                    self.profile.before_step(self.iteration)
                heartbeat.progress(self.iteration + 1, "training step")
                # Megatron's order: the global batch from the samples consumed so far (the ramp-up's); when it
                # changes, Megatron-LM saves a checkpoint first (unless this iteration's is saved already)
                batch = t.global_batch_at(self.consumed_train)
                if batch != self.global_batch and self.iteration and \
                        not (t.save_interval and self.iteration % t.save_interval == 0):
                    self.save()
                self.global_batch = batch
                skipped = self.train_step(loader, self.global_batch)
                self.iteration += 1
                self.consumed_train += self.global_batch
                stats.samples += self.global_batch
                self.checkpointer.poll()  # --async-save: publish a save whose data every rank has written
                stats.iterations += 1
                if skipped:
                    stats.skipped += 1
                    self.total_skipped += 1
                if self.iteration % t.log_interval == 0:
                    self._log_interval(stats)
                    restart_note.record(t.save, self.iteration)
                    stats = IntervalStats(start_time=time.perf_counter())
                if t.eval_interval and self.iteration % t.eval_interval == 0 and t.eval_iters > 0 \
                        and self.valid_ds is not None:
                    if self.manual_gc is not None:
                        self.manual_gc.before_eval()
                    self._validate(f"iteration {self.iteration}")
                    if self.manual_gc is not None:
                        self.manual_gc.after_eval()
                    stats.start_time = time.perf_counter()  # evaluation time is not training time
                if self.manual_gc is not None:  # after the evaluation, as Megatron-LM's step callbacks
                    self.manual_gc.after_step(self.iteration)
                if self.profile is not None:
                    self.profile.after_step(self.iteration)
                if t.save_interval and self.iteration % t.save_interval == 0:
                    self.save()
                if t.exit_duration_in_mins and self._out_of_time(run_start):
                    exit_reason = f"exiting program after {t.exit_duration_in_mins} minutes"
                if t.exit_interval and self.iteration % t.exit_interval == 0:
                    exit_reason = f"exiting program at iteration {self.iteration}"
                if (name := signals.exit_signal()) is not None:  # --exit-signal-handler, agreed by all ranks
                    saved = iteration_dir(t.save, self.iteration) if t.save else "nothing (no --save)"
                    exit_reason = f"exiting program after receiving {name} at iteration {self.iteration}; saved {saved}"
                if exit_reason:
                    break
        except BaseException:
            # stopped by a signal (Interrupted, or a collective failing because another rank stopped):
            # a save already under way still lands; DCP reports rank 0's write done only once every
            # rank has written, so publishing stays safe on any of these paths
            if signals.signalled():
                self.checkpointer.finish_interrupted()
            raise
        finally:
            if self.manual_gc is not None:  # first: what follows may raise
                self.manual_gc.end()
            if self.profile is not None:
                self.profile.close()
            loader.close()
            self.settle()
        # the final state, unless it is already saved or nothing ran since the checkpoint it came from
        if self.iteration and self.iteration != self.loaded_iteration \
                and not (t.save_interval and self.iteration % t.save_interval == 0):
            self.save()
        self.checkpointer.close()  # the last save is published before the run goes on or ends
        if not t.skip_train:
            self.log(datetime_line("after training is done"))
        if exit_reason:
            self.exit_reason = exit_reason
            self.log(exit_reason)
            return
        if t.eval_iters > 0:
            if self.valid_ds is not None:
                self._validate("the end of training for val data")
            if self.test_ds is not None:
                loss = self.test_loss = self.evaluate(self.test_ds, 0, t.eval_iters)
                self.log(metrics.validation_block("the end of training for test data", loss))
        self.tb.close()
