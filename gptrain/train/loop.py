"""The training loop: Megatron's semantics (micro-batches, skipped and NaN iterations, lr schedule in
samples, evaluation, checkpoints) with as few host-device synchronisations as possible.

Sync policy: bf16 and fp32 steps never wait for the device. A non-finite gradient norm becomes a
``found_inf`` tensor that fused AdamW reads on the device to skip the update, and the counters
(loss sum, NaN iterations) stay on the device until the log interval reads them once. fp16 reads
the overflow flag every step, as Megatron does, because the loss scale must react to it.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from gptrain.config import RunConfig
from gptrain.model.fp8 import convert_to_fp8
from gptrain.model.gpt import GPT
from gptrain.train import metrics
from gptrain.train.checkpoint import load_checkpoint, save_checkpoint
from gptrain.train.main_params import MainParams
from gptrain.train.precision import LossScaler
from gptrain.train.schedule import LRSchedule


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many NaN iterations); the message says why and what was saved."""


class MicroBatchLoader:
    """Consecutive micro-batches from ``start`` (a sample index), assembled and pinned in a
    background thread so the copy to the device overlaps compute. Wraps around at the end."""

    def __init__(self, dataset, start: int, micro_batch_size: int, device: torch.device, prefetch: int = 4):
        self.dataset, self.position, self.mbs, self.device = dataset, start, micro_batch_size, device
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
                batch = np.stack([self.dataset[(position + k) % n] for k in range(self.mbs)])
                tensor = torch.from_numpy(batch)
                if self.pin:
                    tensor = tensor.pin_memory()
                position += self.mbs
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
        self.position += self.mbs
        batch = item.to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def build_optimizer(params: dict[str, torch.Tensor], cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW over the named parameters; biases and LayerNorm parameters without weight decay
    (Megatron's rule)."""
    decay, no_decay = [], []
    for p in params.values():
        (no_decay if p.ndim == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
                             eps=cfg.optim.adam_eps, fused=True)


@dataclass
class IntervalStats:
    iterations: int = 0
    skipped: int = 0
    start_time: float = 0.0


# --linear-impl auto: below this many tokens per micro-batch the cuBLASLt ops' host cost (~290
# ctypes/custom-op calls per micro-batch for 24 layers) outweighs their gain (H100, 345M:
# -4.6% at 8 x 1024 tokens, +2.7% at 16 x 1024; benchmarks/RESULTS.md)
AUTO_CUBLASLT_MIN_TOKENS = 16384


class Trainer:
    def __init__(self, cfg: RunConfig, model: GPT, train_ds, valid_ds, test_ds, device: torch.device,
                 log=print, tokens_per_sample: int | None = None):
        self.cfg, self.model, self.device, self.log = cfg, model, device, log
        self.train_ds, self.valid_ds, self.test_ds = train_ds, valid_ds, test_ds
        p = cfg.precision
        self.fp8_layers = convert_to_fp8(model, p.fp8, p.fp8_recipe, emulate=device.type != "cuda") if p.fp8 else 0
        # with --bf16/--fp16 the model turns half precision here and the optimizer steps fp32 main copies
        self.main = MainParams(model, torch.bfloat16 if p.bf16 else torch.float16) if p.half_params else None
        self.linear_impl = self._use_cublaslt(model, cfg)
        self.attention_impl = self._use_flash4(model, cfg)
        # what the optimizer updates and checkpoints hold, by name
        self.opt_params = self.main.named() if self.main else dict(model.named_parameters())
        self.optimizer = build_optimizer(self.opt_params, cfg)
        self.schedule = LRSchedule.from_config(cfg.optim, cfg.train)
        self.scaler = LossScaler.from_config(cfg.precision)
        self.iteration = 0
        self.consumed_train = 0
        self.consumed_valid = 0
        # autocast only where the parameters stay fp32 (--autocast)
        self.compute_dtype = None if p.half_params else torch.bfloat16 if p.bf16 else torch.float16 if p.fp16 else None
        model.compile_loss = cfg.train.compile
        self.forward = torch.compile(model, mode=cfg.train.compile_mode) if cfg.train.compile else model
        self.tb = metrics.TensorBoard(cfg.train.tensorboard_dir)
        self.peak = metrics.device_peak_tflops(device, cfg.train.peak_tflops)
        self.flops_per_token = cfg.model.flops_per_token()
        self.params = list(self.opt_params.values())
        # device-side counters, read once per log interval
        zeros = lambda: torch.zeros((), device=device, dtype=torch.float32)  # noqa: E731
        self._loss_sum, self._advanced, self._nan_count, self._nan_run = zeros(), zeros(), zeros(), zeros()
        self._grad_norm = zeros()
        self.total_skipped = 0
        self.memory_reported = False
        self.last_train_loss: float | None = None
        self.first_train_loss: float | None = None

    @staticmethod
    def _use_cublaslt(model: GPT, cfg: RunConfig) -> str:
        """Switch the model's linear layers to the cuBLASLt ops (needs the final device and dtype);
        says what runs."""
        if cfg.model.linear_impl == "torch":
            return "torch (--linear-impl torch)"
        if cfg.precision.fp8:
            return "torch (fp8 layers do their own matmuls)"
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        if cfg.model.linear_impl == "auto" and tokens < AUTO_CUBLASLT_MIN_TOKENS:
            return (f"torch (auto: {tokens} tokens per micro-batch; cuBLASLt's host cost shows below "
                    f"{AUTO_CUBLASLT_MIN_TOKENS}, --linear-impl cublaslt forces it)")
        reason = model.use_cublaslt(fuse_bias_gelu=cfg.model.bias_gelu_fusion)
        if reason is not None:
            return f"torch (cuBLASLt not usable: {reason})"
        return "cuBLASLt, autotuned" + (", bias-GELU fused" if cfg.model.bias_gelu_fusion else "")

    @staticmethod
    def _use_flash4(model: GPT, cfg: RunConfig) -> str:
        """Switch core attention to FlashAttention-4 under --attention-backend auto/flash4 where it
        can run; says what runs. Asked for by name and unable to run is an error, not a fallback."""
        backend = cfg.model.attention_backend
        if backend not in ("auto", "flash4"):
            return f"SDPA (--attention-backend {backend})"
        reason = model.use_flash4()
        if reason is None:
            return "FlashAttention-4 on packed QKV"
        if backend == "flash4":
            raise ValueError(f"--attention-backend flash4 cannot run: {reason}")
        return f"SDPA, PyTorch's pick (FlashAttention-4 not usable: {reason})"

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
        return {"consumed_train_samples": self.consumed_train, "consumed_valid_samples": self.consumed_valid,
                "schedule": self.schedule.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "config": self.cfg.to_dict(), "format": "gptrain-checkpoint/1"}

    def save(self) -> None:
        if not self.cfg.train.save:
            return
        start = time.perf_counter()
        self.log(f"saving checkpoint at iteration {self.iteration:7d} to {self.cfg.train.save}")
        save_checkpoint(self.cfg.train.save, self.iteration, self.opt_params, self.optimizer, self.state())
        self.log(f"  successfully saved checkpoint at iteration {self.iteration:7d} to {self.cfg.train.save} "
                 f"({time.perf_counter() - start:.2f} s)")

    def load(self) -> None:
        t = self.cfg.train
        if not t.load:
            return
        state = load_checkpoint(t.load, self.opt_params, None if (t.no_load_optim or t.finetune) else self.optimizer,
                                load_rng=not (t.no_load_rng or t.finetune))
        if self.main is not None and state is not None:
            self.main.copy_to_model()
        if state is None:
            self.log(f"WARNING: could not find a checkpoint in {t.load}: training from random initialization")
            return
        if t.finetune:
            self.log(f" loaded weights from {t.load} (iteration {state['iteration']}); --finetune starts at 0")
            return
        self.iteration = int(state["iteration"]) if state["iteration"] != "release" else 0
        self.consumed_train = int(state["consumed_train_samples"])
        self.consumed_valid = int(state["consumed_valid_samples"])
        self.schedule.load_state_dict(state["schedule"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.log(f"  successfully loaded checkpoint from {t.load} at iteration {self.iteration}")

    # ---- one optimisation step
    def train_step(self, loader: MicroBatchLoader) -> bool | None:
        """Forward/backward over the global batch and one update. Returns, for fp16 only, whether
        the step was skipped (bf16/fp32 decide on the device and return None)."""
        n_micro = self.cfg.train.num_micro_batches
        scale = self.loss_scale
        loss_acc = torch.zeros((), device=self.device)
        for _ in range(n_micro):
            tokens, labels = loader.next()
            with self._autocast():
                loss = self.forward(tokens, labels) / n_micro
            (loss * scale if self.scaler else loss).backward()
            if self.main is not None:
                self.main.accumulate_grads()
            loss_acc += loss.detach().float()
        lr = self.schedule.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.scaler is not None:
            found_inf = torch.zeros((), device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                             torch.full((), 1.0 / scale, device=self.device))
            loss_is_finite = math.isfinite(loss_acc.item())
            skipped = bool(found_inf.item()) or not loss_is_finite
            self.scaler.update(skipped)
            self._nan_run = self._nan_run * 0 if loss_is_finite else self._nan_run + 1
            if not skipped:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.clip_grad, foreach=True) \
                    if self.cfg.optim.clip_grad > 0 else torch.zeros(())
                self.optimizer.step()
                self.schedule.step(self.cfg.train.global_batch_size)
                self._grad_norm = grad_norm.detach().float()
                self._loss_sum += loss_acc
                self._advanced += 1
            else:
                self._nan_count += float(not loss_is_finite)
            self._end_step(updated=not skipped)
            return skipped
        if self.main is not None:
            grad_norm = self.main.grad_norm()
        else:
            grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        bad = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_acc)).float()
        # fused AdamW skips the update on the device when found_inf is set, and divides the gradients
        # by grad_scale: gradient clipping (Megatron's max_norm / (norm + 1e-6) when below 1) without
        # a separate pass over the gradients
        self.optimizer.found_inf = bad
        if self.cfg.optim.clip_grad > 0:
            self.optimizer.grad_scale = torch.clamp((grad_norm + 1e-6) / self.cfg.optim.clip_grad, min=1.0)
        self.optimizer.step()
        self._end_step(updated=True)  # a device-side skip left the main weights as they were
        # the schedule advances now; the log interval takes back steps that turned out skipped
        self.schedule.step(self.cfg.train.global_batch_size)
        good = 1.0 - bad
        self._loss_sum += torch.nan_to_num(loss_acc * good, nan=0.0, posinf=0.0, neginf=0.0)
        self._advanced += good
        self._nan_count += bad
        self._nan_run = (self._nan_run + bad) * bad
        self._grad_norm = torch.where(bad > 0, self._grad_norm, grad_norm.detach().float())
        return None

    def _end_step(self, updated: bool) -> None:
        """Drop the gradients; with half-precision parameters, copy the updated main weights in."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.main is not None:
            self.main.release_grads()
            if updated:
                self.main.copy_to_model()

    # ---- evaluation
    @torch.no_grad()
    def evaluate(self, dataset, consumed: int, iters: int) -> float:
        self.model.eval()
        loader = MicroBatchLoader(dataset, consumed, self.cfg.train.micro_batch_size, self.device)
        total = torch.zeros((), device=self.device)
        n = iters * self.cfg.train.num_micro_batches
        try:
            for _ in range(n):
                tokens, labels = loader.next()
                with self._autocast():
                    total += self.model(tokens, labels).float()
        finally:
            loader.close()
            self.model.train()
        return (total / n).item()

    def _validate(self, where: str) -> None:
        t = self.cfg.train
        loss = self.evaluate(self.valid_ds, self.consumed_valid, t.eval_iters)
        self.consumed_valid += t.eval_iters * t.global_batch_size
        self.log(metrics.validation_block(where, loss))
        self.tb.scalars({"lm loss validation": loss, "lm loss validation ppl": math.exp(min(20.0, loss))},
                        self.iteration, self.consumed_train)

    # ---- the loop
    def _log_interval(self, stats: IntervalStats) -> None:
        t = self.cfg.train
        loss_sum, advanced, nan_count, nan_run, grad_norm = torch.stack(
            [self._loss_sum, self._advanced, self._nan_count, self._nan_run, self._grad_norm]).tolist()
        elapsed = time.perf_counter() - stats.start_time
        nans = int(round(nan_count))
        if self.scaler is None and nans:
            # give back the schedule steps of updates skipped on the device (Megatron never takes them)
            self.schedule.num_steps -= nans * t.global_batch_size
        skipped = stats.skipped + (nans if self.scaler is None else 0)
        avg_loss = loss_sum / advanced if advanced > 0 else None
        ms = 1000.0 * elapsed / stats.iterations
        tokens_per_s = stats.iterations * t.global_batch_size * self.cfg.model.seq_length / elapsed
        tflops = tokens_per_s * self.flops_per_token / 1e12
        eta = (t.train_iters - self.iteration) * ms / 1000.0
        line = metrics.iteration_line(self.iteration, t.train_iters, self.consumed_train, ms, self.schedule.lr(),
                                      t.global_batch_size, avg_loss, self.loss_scale,
                                      grad_norm if advanced > 0 else None, skipped, nans)
        self.log(line + metrics.throughput_suffix(tokens_per_s, tflops, self.peak, eta))
        if not self.memory_reported:
            mem = metrics.memory_line(0, self.iteration, self.device)
            if mem:
                self.log(mem)
            self.memory_reported = True
        if avg_loss is not None:
            self.last_train_loss = avg_loss
            if self.first_train_loss is None:
                self.first_train_loss = avg_loss
        self.tb.scalars({"learning-rate": self.schedule.lr(), "batch-size": t.global_batch_size, "lm loss": avg_loss,
                         "loss-scale": self.loss_scale, "grad-norm": grad_norm if advanced > 0 else None,
                         "tokens-per-second-per-gpu": tokens_per_s, "tflops-per-gpu": tflops},
                        self.iteration, self.consumed_train)
        for counter in (self._loss_sum, self._advanced, self._nan_count):
            counter.zero_()
        if nan_run >= t.max_nan_iterations:
            self.save()
            saved = f"the last good state is saved in {t.save}" if t.save else "no --save was given, nothing saved"
            raise TrainingStopped(f"{int(nan_run)} NaN/inf iterations in a row at iteration {self.iteration} "
                                  f"(--max-nan-iterations {t.max_nan_iterations}): stopping; {saved}. Lower --lr, "
                                  "check the data, or use --bf16 instead of --fp16.")

    def train(self) -> None:
        t = self.cfg.train
        self.model.train()
        loader = MicroBatchLoader(self.train_ds, self.consumed_train, t.micro_batch_size, self.device)
        run_start = time.perf_counter()
        stats = IntervalStats(start_time=time.perf_counter())
        exit_reason = None
        try:
            while self.iteration < t.train_iters:
                skipped = self.train_step(loader)
                self.iteration += 1
                self.consumed_train += t.global_batch_size
                stats.iterations += 1
                if skipped:
                    stats.skipped += 1
                    self.total_skipped += 1
                if self.iteration % t.log_interval == 0:
                    self._log_interval(stats)
                    stats = IntervalStats(start_time=time.perf_counter())
                if t.eval_interval and self.iteration % t.eval_interval == 0 and t.eval_iters > 0 \
                        and self.valid_ds is not None:
                    self._validate(f"iteration {self.iteration}")
                    stats.start_time = time.perf_counter()  # evaluation time is not training time
                if t.save_interval and self.iteration % t.save_interval == 0:
                    self.save()
                if t.exit_duration_in_mins and (time.perf_counter() - run_start) / 60.0 > t.exit_duration_in_mins:
                    exit_reason = f"exiting program after {t.exit_duration_in_mins} minutes"
                if t.exit_interval and self.iteration % t.exit_interval == 0:
                    exit_reason = f"exiting program at iteration {self.iteration}"
                if exit_reason:
                    break
        finally:
            loader.close()
        if self.iteration and not (t.save_interval and self.iteration % t.save_interval == 0):
            self.save()
        if exit_reason:
            self.log(exit_reason)
            return
        if t.eval_iters > 0:
            if self.valid_ds is not None:
                self._validate("the end of training for val data")
            if self.test_ds is not None:
                loss = self.evaluate(self.test_ds, 0, t.eval_iters)
                self.log(metrics.validation_block("the end of training for test data", loss))
        self.tb.close()
