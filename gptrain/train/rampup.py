"""Megatron's sample-based training: the batch-size ramp-up (megatron-core's
``RampupBatchsizeNumMicroBatchesCalculator``) or the step schedule that replaced it
(``StepBatchsizeNumMicroBatchesCalculator``), the iteration count of a ``--train-samples`` run
(Megatron-LM's ``update_train_iters``: the ramp-up's iterations, then the rest at the full global batch, a
partial last batch dropped) and ``arguments.py``'s rules on mixing sample- and iteration-based flags.

The data order needs nothing here: Megatron's pretraining sampler reads consecutive chunks of
micro-batch x data-parallel size, each rank its slice, whatever the global batch is, so a step of a
smaller global batch is only fewer micro-batches (data/loader.py reads on from where it stands).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRampup:
    """``--rampup-batch-size START INCREMENT SAMPLES`` growing to ``--global-batch-size``: the global batch
    grows by INCREMENT every SAMPLES / ((global - START) / INCREMENT) consumed samples."""
    start: int
    increment: int
    samples: int
    global_batch_size: int

    def __post_init__(self):
        given = f"--rampup-batch-size {self.start} {self.increment} {self.samples}"
        if self.start < 1 or self.increment < 1 or self.samples < 1:
            raise ValueError(f"{given}: the start batch size, the increment and the ramp-up samples must be positive")
        diff = self.global_batch_size - self.start
        if diff <= 0:
            raise ValueError(f"{given}: the start batch size must be below --global-batch-size "
                             f"{self.global_batch_size} (it ramps up to it)")
        if diff % self.increment:
            raise ValueError(f"{given}: --global-batch-size {self.global_batch_size} minus the start batch size "
                             f"({diff}) is not divisible by the increment {self.increment}")

    @property
    def samples_per_increment(self) -> float:
        return self.samples / ((self.global_batch_size - self.start) // self.increment)

    def global_batch_at(self, consumed: int) -> int:
        """The global batch of the iteration that starts with ``consumed`` samples consumed."""
        if consumed > self.samples:
            return self.global_batch_size
        return self.start + int(consumed / self.samples_per_increment) * self.increment

    def sizes(self) -> list[int]:
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def describe(self) -> str:  # Megatron's line (its logger's), typos mended
        return (f"will use batch size rampup starting from global batch size {self.start} to global batch size "
                f"{self.global_batch_size} with batch size increments {self.increment} over {self.samples} samples.")


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _count(text: str, given: str) -> int:
    """megatron-core's ``_parse_numeric_value``: a number with an optional K, M, B or T."""
    t = text.strip().upper()
    scale = _SUFFIXES.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule {given!r}: {text!r} is not a number (K, M, B or T may "
                         "follow it)") from None


@dataclass(frozen=True)
class StepSchedule:
    """``--step-batch-size-schedule "THRESHOLD:BATCH ..."`` (megatron-core's
    ``StepBatchsizeNumMicroBatchesCalculator``, which replaced the ramp-up in Megatron-LM): from each threshold of
    consumed tokens on (converted to samples by the sequence length, rounded down), that global batch."""
    steps: tuple[tuple[int, int], ...]  # (threshold in samples, global batch), thresholds increasing from 0

    @classmethod
    @functools.lru_cache(maxsize=8)  # rampup_of parses it for every iteration's batch
    def parse(cls, text: str, seq_length: int) -> "StepSchedule":
        steps = []
        for entry in text.strip().replace(",", " ").split():
            if ":" not in entry:
                raise ValueError(f"--step-batch-size-schedule {text!r}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
            threshold, batch = entry.split(":", 1)
            steps.append((_count(threshold, text) // seq_length, _count(batch, text)))
        steps.sort(key=lambda s: s[0])
        if not steps or steps[0][0] != 0:
            raise ValueError(f"--step-batch-size-schedule {text!r}: the first threshold must be 0")
        for (a, _), (b, _) in zip(steps, steps[1:]):
            if b <= a:
                raise ValueError(f"--step-batch-size-schedule {text!r}: thresholds must increase (in samples of "
                                 f"{seq_length} tokens: {a} then {b})")
        if any(batch < 1 for _, batch in steps):
            raise ValueError(f"--step-batch-size-schedule {text!r}: every batch size must be positive")
        return cls(tuple(steps))

    def global_batch_at(self, consumed: int) -> int:
        """The global batch of the iteration that starts with ``consumed`` samples consumed."""
        batch = self.steps[0][1]
        for threshold, size in self.steps:
            if consumed < threshold:
                break
            batch = size
        return batch

    def sizes(self) -> list[int]:
        return [batch for _, batch in self.steps]

    def describe(self) -> str:
        return "using step batch size schedule: " + ", ".join(
            f">= {threshold:,} samples -> global batch {batch}" for threshold, batch in self.steps)


def rampup_of(train) -> BatchRampup | StepSchedule | None:
    """A TrainConfig's ramp-up or step schedule, or None (a constant global batch)."""
    if train.step_batch_size_schedule is not None:
        return StepSchedule.parse(train.step_batch_size_schedule, train.schedule_seq_length)
    if train.rampup_batch_size is None:
        return None
    return BatchRampup(*map(int, train.rampup_batch_size), train.global_batch_size)


def train_iters_for_samples(train_samples: int, global_batch_size: int,
                            rampup: BatchRampup | StepSchedule | None) -> int:
    """Megatron-LM's ``update_train_iters``: ``--train-samples`` over the global batch, or with a ramp-up its
    iterations (up to the first iteration starting past the ramp-up samples) plus the rest at the full
    batch, a partial last batch dropped; with a step schedule, iterations until ``train_samples`` are consumed
    (the last may pass them)."""
    if rampup is None:
        return train_samples // global_batch_size
    if isinstance(rampup, StepSchedule):
        iterations = consumed = 0
        while consumed < train_samples:
            consumed += rampup.global_batch_at(consumed)
            iterations += 1
        return iterations
    iterations = consumed = 0
    while consumed <= rampup.samples:
        consumed += rampup.global_batch_at(consumed)
        iterations += 1
    # Megatron adds (train - consumed) // global, negative where --train-samples ends inside the ramp-up
    return iterations + max(0, (train_samples - consumed) // global_batch_size)


# Megatron's arguments.py assertions, quoted in each message
_MEGATRON = {
    "both": "expected iteration-based training",
    "lr_decay_samples": "expected iteration-based learning rate decay",
    "lr_warmup_samples": "expected iteration-based learning rate warmup",
    "rampup_batch_size": "expected no batch-size rampup for iteration-based training",
    "step_batch_size_schedule": "Cannot specify both --step-batch-size-schedule and --global-batch-size",
    "lr_decay_iters": "expected sample-based learning rate decay",
    "lr_warmup_iters": "expected sample-based learnig rate warmup",
    "fraction": "can only specify one of lr-warmup-fraction and lr-warmup-samples",
}


def check_sample_based(train: dict, optim: dict) -> None:
    """Megatron's rules: iteration-based training (--train-iters) takes no sample-based flag, sample-based
    training (--train-samples) no iteration-based one; the ramp-up needs sample-based training."""
    def refuse(key: str, text: str):
        raise ValueError(f"{text} (Megatron: '{_MEGATRON[key]}')")

    if train["train_iters"] is not None and train["train_samples"] is not None:
        refuse("both", "give --train-iters or --train-samples, not both")
    if train["step_batch_size_schedule"] is not None and train["global_batch_size"] is not None:
        refuse("step_batch_size_schedule", "--step-batch-size-schedule sets the global batch: leave out "
               "--global-batch-size")
    if train["step_batch_size_schedule"] is not None and train["rampup_batch_size"] is not None:
        raise ValueError("--step-batch-size-schedule replaces --rampup-batch-size (deprecated in Megatron-LM): give one")
    if train["train_iters"] is not None and train["step_batch_size_schedule"] is not None:
        raise ValueError("--step-batch-size-schedule with --train-iters is not built: give --train-samples (the "
                         "schedule's thresholds and the learning rate's are in samples then)")
    if train["train_iters"] is not None:
        for key, name in (("rampup_batch_size", "--rampup-batch-size"), ("lr_decay_samples", "--lr-decay-samples")):
            value = train[key] if key in train else optim[key]
            if value is not None:
                refuse(key, f"{name} needs sample-based training: give --train-samples instead of --train-iters")
        if optim["lr_warmup_samples"]:
            refuse("lr_warmup_samples", "--lr-warmup-samples needs sample-based training: give --train-samples "
                   "instead of --train-iters (or --lr-warmup-iters)")
    if train["train_samples"] is not None:
        if optim["lr_decay_iters"] is not None:
            refuse("lr_decay_iters", "--lr-decay-iters with --train-samples: give --lr-decay-samples")
        if optim["lr_warmup_iters"]:
            refuse("lr_warmup_iters", "--lr-warmup-iters with --train-samples: give --lr-warmup-samples")
        if optim["lr_warmup_fraction"] is not None and optim["lr_warmup_samples"]:
            refuse("fraction", "give --lr-warmup-fraction or --lr-warmup-samples, not both")


def micro_batches_line(train, data_parallel: int) -> str:
    """The start-up line on micro-batches per step (Megatron's)."""
    rampup = rampup_of(train)
    if rampup is None:
        return f"setting number of micro-batches to constant {train.micro_batches_per_step(data_parallel)}"
    return rampup.describe()
