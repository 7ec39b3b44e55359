"""``gptrain train``: build tokenizer, data, model and trainer from pretrain_gpt.py flags, and run."""
from __future__ import annotations

import random
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gptrain.config import RunConfig, planned_world_size
from gptrain.data.assemble import build_datasets, setup
from gptrain.device import pick_device
from gptrain.parallel import simulate
from gptrain.parallel.comm_options import describe as describe_comm
from gptrain.parallel.dims import init_distributed, is_logging_rank, world_from_env
from gptrain.parallel.layout import parameter_counts
from gptrain.parallel.teardown import end_process_group
from gptrain.parallel.parallelize import describe_sharding
from gptrain.train.build import build_training, parallel_dims, parameter_count
from gptrain.train import heartbeat, signals
from gptrain.train.checkpoint import CheckpointError
from gptrain.train.checkpoint_files import newest_complete
from gptrain.train.loop import Trainer, TrainingStopped
from gptrain.train.rampup import micro_batches_line
from gptrain.train.save_lock import release_all as release_save_lock
from gptrain.train.startup import (MISSING_CHECKPOINT_LINE, ExitOnMissingCheckpoint, arguments_block,
                                   check_before_build_on_every_rank, datetime_line, megatron_arguments)


SILENT_RANK_GRACE_S = 5.0  # a rank that does not print an error waits this long before it exits


@dataclass
class TrainResult:
    """What a ``gptrain train`` run did, for its callers (the demo, tests) to read instead of its log
    lines; the losses are those the logging rank logs."""
    exit_code: int  # the process's exit code: 0, 1 (training stopped, checkpoint error), 2 (bad flags), signals'
    iteration: int = 0  # the last iteration trained (or loaded, with --skip-train)
    train_losses: list[tuple[int, float]] = field(default_factory=list)  # (iteration, lm loss) per log interval
    validation_losses: list[tuple[int, float]] = field(default_factory=list)  # (iteration, lm loss), end's last
    test_loss: float | None = None  # the end of training's test loss
    exit_reason: str | None = None  # "exiting program ...": a time, iteration or signal limit ended training

    @classmethod
    def of(cls, exit_code: int, trainer: Trainer | None) -> TrainResult:
        if trainer is None:
            return cls(exit_code)
        return cls(exit_code, trainer.iteration, list(trainer.train_losses), list(trainer.validation_losses),
                   trainer.test_loss, trainer.exit_reason)

    @property
    def last_train_loss(self) -> float | None:
        return self.train_losses[-1][1] if self.train_losses else None


def seed_everything(seed: int, tp_rank: int | None = None) -> None:
    """With tensor parallelism (``tp_rank`` given) the process generator takes Megatron's
    tensor-model-parallel seed, seed + 2718 + tp_rank: it only draws the attention dropout, inside
    the tensor-parallel regions, where each rank's heads get their own masks; the dropout outside
    them is hashed (model/dropout.py), the same on every rank."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed if tp_rank is None else seed + 2718 + tp_rank)


def _precision_line(cfg: RunConfig, parts, device: torch.device) -> str:
    p = cfg.precision
    line = f" > precision: {f'{p.name} parameters, fp32 main parameters and gradients' if p.half_params else p.name + (' autocast, fp32 parameters' if p.autocast else '')}"
    if p.fp8:
        line += (f"; fp8 ({p.fp8}, {p.fp8_recipe} scaling) in {parts.fp8_layers} linear layers"
                 + (" (emulated: no fp8 GPU)" if device.type != "cuda" else ""))
    return line


def _report_parameters(parts, log) -> None:
    """Megatron's per-rank line, for every (tensor, pipeline) model-parallel rank, printed by rank 0."""
    count = parameter_count(parts.model)
    counts = {(0, 0): count}
    if parts.mesh is not None:
        coords = (parts.mesh["tp"].get_local_rank(), parts.mesh["pp"].get_local_rank())
        counts = {coords: count}
        if torch.distributed.get_backend() != "fake":  # a simulated rank reports its own only
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, (coords, count))
            counts = dict(gathered)
    for (t, p), n in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        log(f" > number of parameters on (tensor, pipeline) model parallel rank ({t}, {p}): {n}")


def dry_run(cfg: RunConfig, world: int, log) -> None:
    """``--dry-run``: the layout and what each rank would hold, from the meta-device model."""
    dims = parallel_dims(cfg, world)
    log("dry run: flags and layout checked; nothing is built or trained")
    log(dims.describe())
    log(micro_batches_line(cfg.train, dims.dp))
    log(f" > padded vocab (size: {cfg.model.vocab_size}) with "
        f"{cfg.model.padded_vocab_size - cfg.model.vocab_size} dummy tokens (new size: {cfg.model.padded_vocab_size})")
    counts = parameter_counts(cfg.model, dims, cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers)
    for (t, p), n in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        log(f" > number of parameters on (tensor, pipeline) model parallel rank ({t}, {p}): {n}")
    log(f" > parameters: {describe_sharding(dims)}")
    from gptrain.plan.report import dry_run_line

    plan = dry_run_line(cfg, world)
    if plan:
        log(plan)


def _cpu_precision_warning(cfg: RunConfig, device: torch.device) -> str | None:
    if device.type == "cpu" and cfg.precision.fp16:
        return ("WARNING: --fp16 on a CPU runs about 38x slower than fp32 (no fast fp16 matmuls there): "
                "leave out --fp16 for fp32, or use --bf16")
    return None


def train_main(argv: list[str], log=None) -> TrainResult:
    """``gptrain train``: the run's result (its exit code, losses, where it stopped); with
    ``--simulate-world-size N [--simulate-rank R]`` one rank of that world alone through the fake
    process group (parallel/simulate.py)."""
    world, rank, argv = simulate.split_flags(argv)
    if world is not None:
        try:
            with simulate.simulated_world(world, rank):
                return _train_main(argv, log)
        except ValueError as err:
            print(f"gptrain: error: {err}", file=sys.stderr)
            return TrainResult(2)
    return _train_main(argv, log)


def _train_main(argv: list[str], log=None) -> TrainResult:
    log = log or (lambda s: print(s, flush=True))
    trainer = cfg = None
    signals.install(exit_handler="--exit-signal-handler" in argv)
    try:
        world, rank, _ = world_from_env()
        simulated = torch.distributed.is_initialized() and torch.distributed.get_backend() == "fake"
        if rank != 0 and not simulated:  # one rank speaks; every rank still runs the same code
            log = lambda s: None  # noqa: E731
        cfg, tokenizer = setup(argv, log)
        if cfg.train.dry_run:
            dry_run(cfg, planned_world_size(argv), log)
            return TrainResult.of(0, trainer)
        dims = parallel_dims(cfg, world)
        device = init_distributed(pick_device(cfg.train.device), cfg.parallel.distributed_timeout_minutes,
                                  alone=dims.sharded)
        heartbeat.start(cfg.parallel.distributed_timeout_minutes)  # names a rank that stops
        mesh = dims.build_mesh(device.type)
        log(f"{dims.describe()} ; device {device.type}, precision {cfg.precision.name}")
        if mesh is not None and (dims.comm or dims.comm_ignored):  # one process: no communicator to set
            log(describe_comm(dict(dims.comm), list(dims.comm_ignored), device.type))
        check_before_build_on_every_rank(cfg)  # paths and packages, before the model is built
        log(arguments_block(megatron_arguments(cfg, argv, world, dims.dp)))
        if _cpu_precision_warning(cfg, device):
            log(_cpu_precision_warning(cfg, device))
        log(micro_batches_line(cfg.train, dims.dp))
        log(f"> setting random seeds to {cfg.data.seed} ...")
        tp_rank = mesh["tp"].get_local_rank() if dims.tp > 1 else None
        if tp_rank is not None:
            log(f"> tensor-model-parallel seed {cfg.data.seed} + 2718 + tensor rank (attention dropout differs across "
                "tensor-parallel ranks; hidden dropout is the same on all of them)")
        seed_everything(cfg.data.seed, tp_rank)
        log(datetime_line("after megatron is initialized"))
        log("building GPT model ...")
        parts = build_training(cfg, device, dims, mesh, log)
        log(f" > padded vocab (size: {cfg.model.vocab_size}) with "
            f"{cfg.model.padded_vocab_size - cfg.model.vocab_size} dummy tokens (new size: {cfg.model.padded_vocab_size})")
        _report_parameters(parts, log)
        log(datetime_line("after model, optimizer, and learning rate scheduler are built"))
        train_ds, valid_ds, test_ds = build_datasets(cfg, tokenizer, log)
        log(datetime_line("after dataloaders are built"))
        trainer = Trainer(cfg, parts, train_ds, valid_ds, test_ds, device, log)
        log(_precision_line(cfg, parts, device))
        log(f" > parameters: {parts.impls['parameters']}")
        if "offload" in parts.impls:
            log(f" > offload: {parts.impls['offload']}")
        if "compile" in parts.impls:
            log(f" > compile: {parts.impls['compile']}")
        if parts.pipeline is not None:
            log(f" > pipeline: {parts.impls['pipeline']}")
        if "tensor parallel" in parts.impls:
            log(f" > tensor parallel: {parts.impls['tensor parallel']}")
        if "gradient reduction" in parts.impls:
            log(f" > gradient reduction: {parts.impls['gradient reduction']}")
        if "optimizer" in parts.impls:
            log(f" > optimizer: {parts.impls['optimizer']}")
        if "host threads" in parts.impls:
            log(f" > host threads: {parts.impls['host threads']}")
        if trainer.manual_gc is not None and not cfg.train.skip_train:
            every = cfg.train.manual_gc_interval
            log(" > garbage collection: Python's collector off while training (--manual-gc); collections at the "
                + ", ".join(["start"] + (["before and after each evaluation"] if cfg.train.manual_gc_eval else [])
                            + ([f"every {every} iterations"] if every else [])))
        log(f" > linear layers: {trainer.linear_impl.brief(cfg.train.verbose)}")
        log(f" > attention: {trainer.attention_impl.brief(cfg.train.verbose)}")
        trainer.load()
        log("training ...")
        log(datetime_line("before the start of training step"))
        trainer.train()
    except ExitOnMissingCheckpoint:  # Megatron's line and its sys.exit(): status 0
        log(MISSING_CHECKPOINT_LINE)
        return TrainResult.of(0, trainer)
    except TrainingStopped as err:
        if is_logging_rank():
            print(f"gptrain: training stopped: {err}", file=sys.stderr)
        return TrainResult.of(1, trainer)
    except CheckpointError as err:
        if is_logging_rank():
            print(f"gptrain: error: {err}", file=sys.stderr)
        return TrainResult.of(1, trainer)
    except signals.Interrupted as err:  # without --exit-signal-handler: one line, no traceback
        if is_logging_rank():
            where = f" at iteration {trainer.iteration}" if trainer is not None else ""
            saved = newest_complete(cfg.train.save or cfg.train.load) if cfg and (cfg.train.save or cfg.train.load) \
                else "no checkpoint is written without --save"
            print(f"gptrain: stopped by {err.name}{where}; {saved}", file=sys.stderr)
        return TrainResult.of(err.exit_code, trainer)
    except (ValueError, FileNotFoundError) as err:
        if is_logging_rank():
            print(f"gptrain: error: {err}", file=sys.stderr)
        elif world_from_env()[0] > 1:
            # the other ranks hit the same error; torchrun stops every worker when the first one exits, so
            # the silent ranks give rank 0 the time to say why before they go (and go quietly when stopped)
            try:
                time.sleep(SILENT_RANK_GRACE_S)
            except signals.Interrupted:
                pass
        return TrainResult.of(2, trainer)
    except RuntimeError as err:  # a collective timed out: name it on the rank that waited, exit non-zero
        if cfg is None or "timed out" not in str(err).lower():
            raise
        where = f" at iteration {trainer.iteration + 1}" if trainer is not None else ""
        print(f"gptrain: error: rank {world_from_env()[1]} on {socket.gethostname()}: a collective waited longer than "
              f"--distributed-timeout-minutes {cfg.parallel.distributed_timeout_minutes:g}{where} (another rank "
              "stopped, hung or died); exiting so the launcher can restart the group", file=sys.stderr)
        return TrainResult.of(1, trainer)
    finally:
        release_save_lock()  # --save's lock (taken by the start-up checks) ends with the run
        signals.uninstall()
        heartbeat.stop()
        if torch.distributed.is_initialized() and torch.distributed.get_backend() != "fake":
            end_process_group()  # a simulated world ends with its context
    return TrainResult.of(0, trainer)
