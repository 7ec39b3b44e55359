"""A DeepSpeed JSON config (--deepspeed_config ds.json) read as gptrain settings, without DeepSpeed.

Every key is honoured, accepted with a note saying why it changes nothing here (gptrain shards with
PyTorch FSDP2, not DeepSpeed's engine), or refused by name: an unknown key is an error, never ignored,
so no setting of the user's run is silently dropped.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, NoReturn


@dataclass(frozen=True)
class DeepSpeedSettings:
    zero_stage: int
    cpu_offload: bool
    fp16: bool | None
    bf16: bool | None
    loss_scale: float | None
    initial_loss_scale: float | None
    loss_scale_window: int | None
    hysteresis: int | None
    min_loss_scale: float | None
    train_batch_size: int | None
    train_micro_batch_size_per_gpu: int | None
    gradient_accumulation_steps: int | None
    gradient_clipping: float | None
    offload_ratio: float | None = None  # offload_optimizer.ratio: --optimizer-offload-fraction
    notes: tuple[str, ...] = ()
    source: str = "ds_config"  # the file's name, for resolve_batch_sizes' errors


_MISSING = object()

_REFUSED = {
    "optimizer": "gptrain takes the optimizer from Megatron flags (--optimizer, --lr, --adam-beta1, --adam-beta2, "
                 "--adam-eps, --weight-decay); remove this section and pass those flags",
    "scheduler": "the learning-rate schedule comes from Megatron flags (--lr-decay-style, --lr-warmup-iters, "
                 "--lr-decay-iters, --min-lr); remove this section and pass those flags",
    "activation_checkpointing": "use --checkpoint-activations / --recompute-activations",
    "amp": "Apex AMP is not used; use the fp16 or bf16 section (or --fp16 / --bf16)",
    "pipeline": "DeepSpeed's pipeline engine is not used; the layout comes from --pipeline-model-parallel-size",
    "sparse_attention": "DeepSpeed sparse attention is not supported",
    "data_efficiency": "DeepSpeed data efficiency (data sampling and routing) is not supported",
    "curriculum_learning": "curriculum learning is not supported",
    "compression_training": "compression training is not supported",
    "elasticity": "elastic training is not supported; batch sizes are fixed",
}

# They tune DeepSpeed's own ZeRO engine (buckets, prefetching, overlap); FSDP2 has its own.
_ZERO_ENGINE_KEYS = (
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size", "round_robin_gradients",
)
_ZERO_KEYS = ("stage", "cpu_offload", "offload_optimizer", "offload_param") + _ZERO_ENGINE_KEYS
_FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
              "auto_cast")
_TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "fp16", "bf16", "bfloat16", "zero_optimization", "steps_per_print",
             "wall_clock_breakdown", "zero_allow_untested_optimizer", "prescale_gradients",
             "gradient_predivide_factor", "communication_data_type", "flops_profiler", "tensorboard")

# Accepted with a note as long as they hold DeepSpeed's default, which is what gptrain does anyway.
_ONLY = {  # key: (accepted values, why another value is refused)
    "prescale_gradients": ((False,), "gptrain averages gradients in the reduction only, never before it"),
    "gradient_predivide_factor": ((1.0,), "gptrain does not pre-divide gradients before the reduction"),
    "communication_data_type": (("fp32", "float32"), "gptrain reduces gradients in fp32"),
}
_NOTES = {
    "steps_per_print": "DeepSpeed's own progress print; gptrain logs every --log-interval iterations",
    "wall_clock_breakdown": "DeepSpeed's own timers; gptrain does not use DeepSpeed's engine",
    "zero_allow_untested_optimizer": "a DeepSpeed check on user-built optimizers; gptrain builds its own",
    "prescale_gradients": "false is DeepSpeed's default and what gptrain does",
    "gradient_predivide_factor": "1.0 is DeepSpeed's default and what gptrain does",
    "communication_data_type": "gptrain reduces gradients in fp32",
    "tensorboard": "DeepSpeed's own TensorBoard writer is not used; use --tensorboard-dir",
    "flops_profiler": "DeepSpeed's FLOPs profiler, disabled here",
}


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.notes: list[str] = []

    def error(self, path: str, message: str, value: Any = _MISSING) -> NoReturn:
        shown = path if value is _MISSING else f"{path} {json.dumps(value)}"
        raise ValueError(f"{self.source}: {shown}: {message}")

    def note(self, path: str, message: str) -> None:
        self.notes.append(f"{self.source}: {path}: {message}")

    def section(self, parent: dict | None, key: str, path: str) -> dict | None:
        """The sub-object at key, None when absent."""
        if parent is None or key not in parent:
            return None
        value = parent[key]
        if not isinstance(value, dict):
            self.error(path, "must be a JSON object", value)
        return value

    def known(self, section: dict | None, path: str, keys: tuple[str, ...]) -> None:
        for key in section or ():
            if key not in keys:
                self.error(f"{path}.{key}", "not a DeepSpeed key gptrain knows; it refuses what it cannot honour")

    def auto(self, value: Any, path: str) -> bool:
        # Hugging Face's integration fills "auto" in from its own arguments; here Megatron flags do.
        if isinstance(value, str) and value == "auto":
            self.note(path, '"auto": left to the Megatron flags and gptrain\'s defaults')
            return True
        return False

    def number(self, section: dict | None, key: str, path: str, kind: type, positive: bool) -> Any:
        """An int or float (kind) at section[key]; None when absent or "auto"."""
        if section is None or key not in section or self.auto(section[key], path):
            return None
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.error(path, "must be a number", value)
        if kind is int:
            if value != int(value):
                self.error(path, "must be a whole number", value)
            value = int(value)
        if value < 0 or (positive and value == 0):
            self.error(path, "must be positive" if positive else "must not be negative", value)
        return kind(value)

    def flag(self, section: dict | None, key: str, path: str, default: bool | None) -> bool | None:
        if section is None or key not in section:
            return default
        value = section[key]
        if self.auto(value, path):
            return None
        if not isinstance(value, bool):
            self.error(path, "must be true or false", value)
        return value

    def only(self, section: dict, key: str, path: str, allowed: tuple, why: str, note: str) -> None:
        """A key accepted with a note while it holds one of the values gptrain behaves as."""
        value = section[key]
        if self.auto(value, path):
            return
        if isinstance(value, bool) or isinstance(allowed[0], bool):
            ok = any(value is a for a in allowed)
        elif isinstance(allowed[0], str):
            ok = isinstance(value, str) and value.lower() in allowed
        else:
            ok = isinstance(value, (int, float)) and value in allowed
        if not ok:
            self.error(path, why, value)
        self.note(path, note)


def read_deepspeed_config(path: str | os.PathLike) -> DeepSpeedSettings:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed config {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return parse_deepspeed_config(config, source=path)


def parse_deepspeed_config(config: dict, source: str = "ds_config") -> DeepSpeedSettings:
    p = _Parser(source)
    if not isinstance(config, dict):
        raise ValueError(f"{source}: must hold a JSON object at the top level, not {type(config).__name__}")
    for key in config:
        if key in _REFUSED:
            p.error(key, _REFUSED[key])
        if key not in _TOP_KEYS:
            p.error(key, "not a DeepSpeed key gptrain knows; it refuses what it cannot honour")

    for key, (allowed, why) in _ONLY.items():
        if key in config:
            p.only(config, key, key, allowed, why, _NOTES[key])
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"):
        if key in config:
            p.note(key, _NOTES[key])
    tensorboard = p.section(config, "tensorboard", "tensorboard")
    p.known(tensorboard, "tensorboard", ("enabled", "output_path", "job_name"))
    if tensorboard is not None:
        p.note("tensorboard", _NOTES["tensorboard"])
    profiler = p.section(config, "flops_profiler", "flops_profiler")
    p.known(profiler, "flops_profiler",
            ("enabled", "profile_step", "module_depth", "top_modules", "detailed", "output_file"))
    if profiler is not None:
        if p.flag(profiler, "enabled", "flops_profiler.enabled", False):
            p.error("flops_profiler.enabled", "DeepSpeed's FLOPs profiler is not available; gptrain logs its "
                    "own throughput", True)
        p.note("flops_profiler", _NOTES["flops_profiler"])

    # Precision: the section's presence with "enabled" missing means DeepSpeed's default, false.
    fp16 = p.section(config, "fp16", "fp16")
    p.known(fp16, "fp16", _FP16_KEYS)
    fp16_on = p.flag(fp16, "enabled", "fp16.enabled", False if fp16 is not None else None)
    if fp16 is not None and "auto_cast" in fp16:
        p.only(fp16, "auto_cast", "fp16.auto_cast", (False,),
               "gptrain does not cast the model's inputs to fp16", "false is DeepSpeed's default")
    loss_scale = p.number(fp16, "loss_scale", "fp16.loss_scale", float, positive=False) or None  # 0: dynamic
    power = p.number(fp16, "initial_scale_power", "fp16.initial_scale_power", int, positive=False)
    if power is not None and power > 64:
        p.error("fp16.initial_scale_power", "must be at most 64", power)
    if "bf16" in config and "bfloat16" in config:
        p.error("bfloat16", "give bf16 or its old name bfloat16, not both")
    bf16_key = "bfloat16" if "bfloat16" in config else "bf16"
    bf16 = p.section(config, bf16_key, bf16_key)
    p.known(bf16, bf16_key, ("enabled",))
    bf16_on = p.flag(bf16, "enabled", f"{bf16_key}.enabled", False if bf16 is not None else None)
    if fp16_on and bf16_on:
        p.error("fp16.enabled", f"{bf16_key}.enabled is true too: choose one precision", True)

    zero = p.section(config, "zero_optimization", "zero_optimization")
    stage, offload_by = 0, None  # offload_by: the key and value that asked for offload, for the error
    ratio = None
    if zero is not None:
        p.known(zero, "zero_optimization", _ZERO_KEYS)
        stage = p.number(zero, "stage", "zero_optimization.stage", int, positive=False) or 0
        if stage > 3:
            p.error("zero_optimization.stage", "ZeRO stages are 0 to 3", stage)
        if p.flag(zero, "cpu_offload", "zero_optimization.cpu_offload", False):
            offload_by = ("zero_optimization.cpu_offload", True)
        for name in ("offload_optimizer", "offload_param"):
            path = f"zero_optimization.{name}"
            sub = p.section(zero, name, path)
            if sub is None:
                continue
            # The device first: an nvme section's nvme_path and buffers are refused by the device's reason.
            device = sub.get("device", "none")
            if p.auto(device, f"{path}.device"):
                device = "none"
            if device == "nvme":
                p.error(f"{path}.device", "gptrain offloads to the CPU only", device)
            if device not in ("cpu", "none"):
                p.error(f"{path}.device", 'must be "cpu" or "none"', device)
            keys = ("device", "pin_memory", "ratio") if name == "offload_optimizer" else ("device", "pin_memory")
            p.known(sub, path, keys)
            p.flag(sub, "pin_memory", f"{path}.pin_memory", None)
            if name == "offload_optimizer" and "ratio" in sub:
                # ZeRO-Offload++'s share of the optimizer state on the CPU: --optimizer-offload-fraction; DeepSpeed
                # reads it at stage 3 only (stage3.py) and offloads everything below, so gptrain does the same
                ratio = p.number(sub, "ratio", f"{path}.ratio", float, positive=True)
                if ratio is not None and ratio > 1:
                    p.error(f"{path}.ratio", "must be at most 1", ratio)
                if ratio is not None and ratio < 1 and stage != 3:
                    p.note(f"{path}.ratio", f"DeepSpeed applies it at stage 3 only: stage {stage} offloads all of "
                           "the optimizer state, as DeepSpeed does (--optimizer-offload-fraction keeps part of it "
                           "on the GPU at any stage)")
                    ratio = None
            if device == "cpu" and name == "offload_param" and stage != 3:
                p.error(f"{path}.device", f"offloads parameters, which only stage 3 shards (DeepSpeed's rule; "
                        f"this file has stage {stage}): use offload_optimizer", device)
            if device == "cpu" and offload_by is None:
                offload_by = (f"{path}.device", "cpu")
        for key in zero:
            if key in _ZERO_ENGINE_KEYS:
                p.note(f"zero_optimization.{key}", "tunes DeepSpeed's own ZeRO engine; gptrain shards with "
                       "PyTorch FSDP2, which has no such setting")
    if offload_by is not None and stage == 0:
        p.error(offload_by[0], "cpu offload needs zero_optimization.stage 1, 2 or 3 (this file has stage 0)",
                offload_by[1])


    return DeepSpeedSettings(
        zero_stage=stage,
        cpu_offload=offload_by is not None,
        offload_ratio=ratio if offload_by is not None else None,
        fp16=fp16_on,
        bf16=bf16_on,
        loss_scale=loss_scale,
        initial_loss_scale=None if power is None else 2.0 ** power,
        loss_scale_window=p.number(fp16, "loss_scale_window", "fp16.loss_scale_window", int, positive=True),
        hysteresis=p.number(fp16, "hysteresis", "fp16.hysteresis", int, positive=True),
        min_loss_scale=p.number(fp16, "min_loss_scale", "fp16.min_loss_scale", float, positive=True),
        train_batch_size=p.number(config, "train_batch_size", "train_batch_size", int, positive=True),
        train_micro_batch_size_per_gpu=p.number(config, "train_micro_batch_size_per_gpu",
                                                "train_micro_batch_size_per_gpu", int, positive=True),
        gradient_accumulation_steps=p.number(config, "gradient_accumulation_steps", "gradient_accumulation_steps",
                                             int, positive=True),
        gradient_clipping=p.number(config, "gradient_clipping", "gradient_clipping", float, positive=False),
        notes=tuple(p.notes),
        source=source,
    )


def resolve_batch_sizes(settings: DeepSpeedSettings, data_parallel_size: int, micro_batch_size: int | None,
                        global_batch_size: int | None) -> tuple[int, int]:
    """(micro, global) batch sizes under DeepSpeed's rule train_batch_size = micro x grad_accum x dp.

    The file and the Megatron flags (None when not given) fill each other in and must agree.
    """
    src, dp = settings.source, data_parallel_size
    for name, value in (("data-parallel size", dp), ("--micro-batch-size", micro_batch_size),
                        ("--global-batch-size", global_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{src}: {name} {value} must be positive")

    def agree(ds_name: str, ds_value: int | None, flag: str, flag_value: int | None) -> tuple[str, int | None]:
        if ds_value is not None and flag_value is not None and ds_value != flag_value:
            raise ValueError(f"{src}: {ds_name} {ds_value} != {flag} {flag_value}")
        return (ds_name, ds_value) if ds_value is not None else (flag, flag_value)

    micro_name, micro = agree("train_micro_batch_size_per_gpu", settings.train_micro_batch_size_per_gpu,
                              "--micro-batch-size", micro_batch_size)
    global_name, glob = agree("train_batch_size", settings.train_batch_size, "--global-batch-size", global_batch_size)
    accum = settings.gradient_accumulation_steps

    if micro is None:
        if glob is not None and accum is not None:
            if glob % (accum * dp):
                raise ValueError(f"{src}: {global_name} {glob} is not divisible by gradient_accumulation_steps "
                                 f"{accum} x data-parallel size {dp} (= {accum * dp})")
            micro = glob // (accum * dp)
        elif settings.train_batch_size is not None:
            # DeepSpeed given train_batch_size alone runs one micro-batch per step: the user's run as it was.
            if glob % dp:
                raise ValueError(f"{src}: {global_name} {glob} is not divisible by data-parallel size {dp}")
            micro = glob // dp
        else:
            micro = 1  # Megatron's default
    if glob is None:
        return micro, micro * (accum or 1) * dp
    if accum is not None and glob != micro * accum * dp:
        raise ValueError(f"{src}: {global_name} {glob} != {micro_name} {micro} x gradient_accumulation_steps "
                         f"{accum} x data-parallel size {dp} (= {micro * accum * dp})")
    if glob % (micro * dp):
        raise ValueError(f"{src}: {global_name} {glob} is not divisible by {micro_name} {micro} x data-parallel "
                         f"size {dp} (= {micro * dp})")
    return micro, glob


def apply_deepspeed_config(values: dict[str, dict], zero_flag: int | None, data_parallel: int) -> list[str]:
    """(config.parse_megatron_args) Fold a ds.json into the flags' values, by section (precision, loss scaling, batch sizes,
    clipping, the ZeRO stage, CPU offload); a value that contradicts a flag is an error naming both.
    ``zero_flag``: --zero-stage as given (None: not given)."""
    precision, parallel, train = values["precision"], values["parallel"], values["train"]
    name = parallel["deepspeed_config"]
    ds = read_deepspeed_config(name)
    if ds.fp16 and precision["bf16"] or ds.bf16 and precision["fp16"]:
        raise ValueError(f"{name}: {'fp16' if ds.fp16 else 'bf16'}.enabled contradicts "
                         f"{'--bf16' if precision['bf16'] else '--fp16'}")
    precision["fp16"] = precision["fp16"] or bool(ds.fp16)
    precision["bf16"] = precision["bf16"] or bool(ds.bf16)
    for field_name in ("loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"):
        value = getattr(ds, field_name)
        if value is not None:
            precision[field_name] = value
    if ds.gradient_clipping is not None:
        values["optim"]["clip_grad"] = ds.gradient_clipping
    if zero_flag is not None and zero_flag != ds.zero_stage:
        raise ValueError(f"{name}: zero_optimization.stage {ds.zero_stage} contradicts --zero-stage {zero_flag}")
    parallel["zero_stage"] = max(parallel["zero_stage"], ds.zero_stage)
    parallel["cpu_offload"] = parallel["cpu_offload"] or ds.cpu_offload
    if ds.offload_ratio is not None:
        if parallel["offload_fraction"] not in (None, ds.offload_ratio):
            raise ValueError(f"{name}: zero_optimization.offload_optimizer.ratio {ds.offload_ratio:g} contradicts "
                             f"--optimizer-offload-fraction {parallel['offload_fraction']:g}")
        parallel["offload_fraction"] = ds.offload_ratio
    train["micro_batch_size"], train["global_batch_size"] = resolve_batch_sizes(
        ds, data_parallel, train["micro_batch_size"], train["global_batch_size"])
    return list(ds.notes) + [
        f"{name}: ZeRO stage {parallel['zero_stage']}" + (", CPU offload" if parallel["cpu_offload"] else "")
        + f", micro-batch {train['micro_batch_size']}, global batch {train['global_batch_size']}"]
