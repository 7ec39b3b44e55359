"""Megatron's sample-based training: the batch-size ramp-up (megatron-core's
``RampupBatchsizeNumMicroBatchesCalculator``), the iteration count of a ``--train-samples`` run
(Megatron-LM's ``update_train_iters``: the ramp-up's iterations, then the rest at the full global batch, a
partial last batch dropped) and ``arguments.py``'s rules on mixing sample- and iteration-based flags.

The data order needs nothing here: Megatron's pretraining sampler reads consecutive chunks of
micro-batch x data-parallel size, each rank its slice, whatever the global batch is, so a step of a
smaller global batch is only fewer micro-batches (data/loader.py reads on from where it stands).
"""
from __future__ import annotations

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


def rampup_of(train) -> BatchRampup | None:
    """A TrainConfig's ramp-up, or None (a constant global batch)."""
    if train.rampup_batch_size is None:
        return None
    return BatchRampup(*map(int, train.rampup_batch_size), train.global_batch_size)


def train_iters_for_samples(train_samples: int, global_batch_size: int, rampup: BatchRampup | None) -> int:
    """Megatron-LM's ``update_train_iters``: ``--train-samples`` over the global batch, or with a ramp-up its
    iterations (up to the first iteration starting past the ramp-up samples) plus the rest at the full
    batch; a partial last batch is dropped."""
    if rampup is None:
        return train_samples // global_batch_size
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
