"""DeepSpeed JSON configs as Megatron-DeepSpeed users write them, read into gptrain settings."""
from __future__ import annotations

import json

import pytest

from gptrain.parallel.deepspeed_config import (DeepSpeedSettings, parse_deepspeed_config, read_deepspeed_config,
                                               resolve_batch_sizes)

# The ZeRO-3 offload file of Megatron-DeepSpeed's examples, byte for byte as users write it.
MEGATRON_DS_ZERO3 = """{
"fp16": {"enabled": true},
"zero_optimization": {"stage": 3, "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
 "reduce_scatter": true, "reduce_bucket_size": 2e8, "contiguous_gradients": true, "cpu_offload": true}
}
"""


def write(tmp_path, config, name="ds.json"):
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def refused(config, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        parse_deepspeed_config(config, source="ds.json")
    message = str(info.value)
    assert message.startswith("ds.json: ") and "\n" not in message
    return message


def settings(**batch) -> DeepSpeedSettings:
    fields = dict(zero_stage=0, cpu_offload=False, fp16=None, bf16=None, loss_scale=None, initial_loss_scale=None,
                  loss_scale_window=None, hysteresis=None, min_loss_scale=None, train_batch_size=None,
                  train_micro_batch_size_per_gpu=None, gradient_accumulation_steps=None, gradient_clipping=None,
                  source="ds.json")
    return DeepSpeedSettings(**(fields | batch))


def test_megatron_deepspeed_zero3_offload_file(tmp_path):
    s = read_deepspeed_config(write(tmp_path, MEGATRON_DS_ZERO3))
    assert (s.zero_stage, s.cpu_offload, s.fp16, s.bf16) == (3, True, True, None)
    assert s.loss_scale is None and s.initial_loss_scale is None  # dynamic scaling with gptrain's defaults
    assert s.train_batch_size is None and s.gradient_clipping is None
    assert any("zero_optimization.allgather_bucket_size" in n for n in s.notes)
    # one note per accepted engine key, none for the honoured stage / cpu_offload
    assert len(s.notes) == 6 and not any(".stage" in n or "cpu_offload" in n for n in s.notes)
    assert all(n.startswith(str(tmp_path / "ds.json") + ": ") for n in s.notes)


def test_bf16_with_optimizer_offload(tmp_path):
    s = read_deepspeed_config(write(tmp_path, {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "steps_per_print": 10, "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "none"}},
    }))
    assert (s.zero_stage, s.cpu_offload, s.fp16, s.bf16) == (3, True, None, True)
    assert (s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_clipping) == (64, 4, 1.0)
    assert isinstance(s.train_batch_size, int) and isinstance(s.gradient_clipping, float)
    assert any(n.endswith("steps_per_print: DeepSpeed's own progress print; gptrain logs every --log-interval "
                          "iterations") for n in s.notes)


@pytest.mark.parametrize("offload", [{"offload_param": {"device": "cpu"}}, {"offload_optimizer": {"device": "cpu"}}])
def test_offload_device_cpu_alone_turns_offload_on(offload):
    assert parse_deepspeed_config({"zero_optimization": {"stage": 3, **offload}}).cpu_offload


def test_old_bfloat16_key_and_defaults():
    s = parse_deepspeed_config({"bfloat16": {"enabled": True}, "fp16": {}})
    assert (s.bf16, s.fp16, s.zero_stage, s.cpu_offload) == (True, False, 0, False)  # section without enabled: false
    s = parse_deepspeed_config({})
    assert (s.zero_stage, s.cpu_offload, s.fp16, s.bf16, s.notes) == (0, False, None, None, ())


def test_auto_values_are_absent_with_a_note():
    s = parse_deepspeed_config({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto", "loss_scale": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    }, source="ds.json")
    assert (s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps) == (None,) * 3
    assert (s.gradient_clipping, s.fp16, s.bf16, s.loss_scale) == (None,) * 4
    auto_notes = [n for n in s.notes if '"auto"' in n]
    assert len(auto_notes) == 7
    assert 'ds.json: fp16.enabled: "auto": left to the Megatron flags and gptrain\'s defaults' in auto_notes
    assert any("zero_optimization.reduce_bucket_size" in n for n in s.notes)


def test_loss_scaling():
    s = parse_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 16,
                                         "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1}})
    assert (s.loss_scale, s.initial_loss_scale, s.loss_scale_window, s.hysteresis, s.min_loss_scale) == \
        (128.0, 65536.0, 500, 2, 1.0)
    assert isinstance(s.loss_scale, float) and isinstance(s.loss_scale_window, int)
    assert parse_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 0}}).loss_scale is None  # 0: dynamic


def test_accepted_with_a_note():
    s = parse_deepspeed_config({
        "prescale_gradients": False, "gradient_predivide_factor": 1.0, "communication_data_type": "FP32",
        "zero_allow_untested_optimizer": True, "fp16": {"enabled": True, "auto_cast": False},
        "flops_profiler": {"enabled": False, "profile_step": 1, "detailed": True},
        "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "gpt"},
    }, source="ds.json")
    noted = {n.split(": ")[1] for n in s.notes}
    assert noted == {"prescale_gradients", "gradient_predivide_factor", "communication_data_type",
                     "zero_allow_untested_optimizer", "fp16.auto_cast", "flops_profiler", "tensorboard"}
    assert any("--tensorboard-dir" in n for n in s.notes)


@pytest.mark.parametrize("config, match", [
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}, r"^ds\.json: optimizer: .*Megatron flags.*--lr"),
    ({"scheduler": {"type": "WarmupLR"}}, r"^ds\.json: scheduler: .*--lr-decay-style"),
    ({"activation_checkpointing": {"partition_activations": True}},
     r"^ds\.json: activation_checkpointing: use --checkpoint-activations / --recompute-activations$"),
    ({"amp": {"enabled": True}}, r"^ds\.json: amp: "),
    ({"pipeline": {"stages": "auto"}}, r"^ds\.json: pipeline: "),
    ({"sparse_attention": {"mode": "fixed"}}, r"^ds\.json: sparse_attention: "),
    ({"data_efficiency": {"enabled": True}}, r"^ds\.json: data_efficiency: "),
    ({"curriculum_learning": {"enabled": True}}, r"^ds\.json: curriculum_learning: "),
    ({"compression_training": {}}, r"^ds\.json: compression_training: "),
    ({"elasticity": {"enabled": True}}, r"^ds\.json: elasticity: "),
    ({"zero_optimization": {"stage": 4}}, r'^ds\.json: zero_optimization\.stage 4: ZeRO stages are 0 to 3$'),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}},
     r'^ds\.json: zero_optimization\.offload_param\.device "nvme": gptrain offloads to the CPU only$'),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     r'^ds\.json: zero_optimization\.offload_optimizer\.device "nvme": gptrain offloads to the CPU only$'),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}},
     r'offload_optimizer\.device "gpu": must be "cpu" or "none"'),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r'^ds\.json: zero_optimization\.offload_param\.device "cpu": offloads parameters, which only stage 3 shards '
     r"\(DeepSpeed's rule; this file has stage 2\): use offload_optimizer$"),
    ({"zero_optimization": {"cpu_offload": True}},
     r"^ds\.json: zero_optimization\.cpu_offload true: cpu offload needs zero_optimization\.stage 1, 2 or 3 "
     r"\(this file has stage 0\)$"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"^ds\.json: fp16\.enabled true: bf16\.enabled is true"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, r"^ds\.json: bfloat16: give bf16 or its old name"),
    ({"prescale_gradients": True}, r"^ds\.json: prescale_gradients true: "),
    ({"gradient_predivide_factor": 2.0}, r"^ds\.json: gradient_predivide_factor 2\.0: "),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r"^ds\.json: fp16\.auto_cast true: "),
    ({"communication_data_type": "fp16"}, r'^ds\.json: communication_data_type "fp16": gptrain reduces .* fp32$'),
    ({"flops_profiler": {"enabled": True}}, r"^ds\.json: flops_profiler\.enabled true: "),
    ({"train_batch_size": 0}, r"^ds\.json: train_batch_size 0: must be positive$"),
    ({"train_micro_batch_size_per_gpu": 2.5}, r"train_micro_batch_size_per_gpu 2\.5: must be a whole number"),
    ({"gradient_accumulation_steps": True}, r"gradient_accumulation_steps true: must be a number"),
    ({"gradient_clipping": "1.0"}, r'gradient_clipping "1\.0": must be a number'),
    ({"fp16": {"enabled": 1}}, r"fp16\.enabled 1: must be true or false"),
    ({"fp16": True}, r"^ds\.json: fp16 true: must be a JSON object$"),
])
def test_refused_by_name(config, match):
    refused(config, match)


@pytest.mark.parametrize("config, key", [
    ({"train_batch_sizes": 8}, "train_batch_sizes"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 5}}},
     "zero_optimization.offload_param.buffer_count"),
    ({"tensorboard": {"enabled": True, "flush": 1}}, "tensorboard.flush"),
])
def test_unknown_keys_are_refused_not_ignored(config, key):
    message = refused(config, "not a DeepSpeed key gptrain knows")
    assert message.startswith(f"ds.json: {key}: ")


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_deepspeed_config(tmp_path / "missing.json")
    bad = write(tmp_path, '{\n"fp16": {"enabled": true,}\n}', name="bad.json")
    with pytest.raises(ValueError) as info:
        read_deepspeed_config(bad)
    assert str(info.value) == f"{bad}: not valid JSON: Expecting property name enclosed in double quotes at line 2 " \
                              "column 26"
    with pytest.raises(ValueError, match=r"list\.json: must hold a JSON object at the top level, not list"):
        read_deepspeed_config(write(tmp_path, "[1, 2]", name="list.json"))
    with pytest.raises(ValueError, match=r"^.*ds\.json: optimizer: "):  # the file's path names the errors
        read_deepspeed_config(write(tmp_path, {"optimizer": {"type": "Adam"}}))


@pytest.mark.parametrize("ds, dp, flags, expected", [
    ({}, 4, (None, None), (1, 4)),  # nothing anywhere: Megatron's defaults
    ({}, 2, (4, None), (4, 8)),  # Megatron flags only
    ({}, 2, (4, 32), (4, 32)),
    ({}, 2, (None, 32), (1, 32)),  # --global-batch-size alone keeps Megatron's micro-batch 1
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, (None, None), (2, 16)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (None, None), (4, 16)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (None, None), (2, 16)),
    ({"train_batch_size": 16}, 4, (None, None), (4, 16)),  # DeepSpeed alone: one micro-batch per step
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2,
     (None, None), (2, 16)),
    ({"gradient_accumulation_steps": 3}, 2, (None, None), (1, 6)),
    ({"gradient_accumulation_steps": 2}, 2, (4, None), (4, 16)),
    ({"train_batch_size": 16}, 2, (2, None), (2, 16)),  # flags fill the file's gaps
    ({"train_micro_batch_size_per_gpu": 2}, 2, (None, 16), (2, 16)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (2, 16), (2, 16)),  # agreeing twice
])
def test_batch_sizes_filled_in(ds, dp, flags, expected):
    assert resolve_batch_sizes(settings(**ds), dp, *flags) == expected


@pytest.mark.parametrize("ds, dp, flags, message", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2,
     (None, None), "ds.json: train_batch_size 16 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps "
                   "2 x data-parallel size 2 (= 8)"),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (2, None),
     "ds.json: train_batch_size 16 != --micro-batch-size 2 x gradient_accumulation_steps 2 x data-parallel size 2 "
     "(= 8)"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2, (None, 32),
     "ds.json: --global-batch-size 32 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 2 x "
     "data-parallel size 2 (= 8)"),
    ({"train_micro_batch_size_per_gpu": 2}, 1, (4, None), "ds.json: train_micro_batch_size_per_gpu 2 != "
                                                          "--micro-batch-size 4"),
    ({"train_batch_size": 16}, 1, (None, 32), "ds.json: train_batch_size 16 != --global-batch-size 32"),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 3}, 2, (None, None),
     "ds.json: train_batch_size 16 is not divisible by gradient_accumulation_steps 3 x data-parallel size 2 (= 6)"),
    ({"train_batch_size": 15}, 2, (None, None), "ds.json: train_batch_size 15 is not divisible by data-parallel "
                                                "size 2"),
    ({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 4}, 2, (None, None),
     "ds.json: train_batch_size 20 is not divisible by train_micro_batch_size_per_gpu 4 x data-parallel size 2 "
     "(= 8)"),
    ({}, 4, (2, 12), "ds.json: --global-batch-size 12 is not divisible by --micro-batch-size 2 x data-parallel "
                     "size 4 (= 8)"),
    ({}, 0, (None, None), "ds.json: data-parallel size 0 must be positive"),
    ({}, 1, (0, None), "ds.json: --micro-batch-size 0 must be positive"),
])
def test_batch_size_contradictions(ds, dp, flags, message):
    with pytest.raises(ValueError) as info:
        resolve_batch_sizes(settings(**ds), dp, *flags)
    assert str(info.value) == message


def test_batch_sizes_from_a_parsed_file(tmp_path):
    s = read_deepspeed_config(write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                               "gradient_accumulation_steps": 2}))
    with pytest.raises(ValueError, match=r"ds\.json: train_batch_size 16 != .* \(= 8\)$"):
        resolve_batch_sizes(s, 2, None, None)
    assert resolve_batch_sizes(s, 4, None, None) == (2, 16)


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_offload_at_stages_1_and_2(stage):
    """DeepSpeed's ZeRO-1/2 with offload_optimizer (seeds' and users' usual one-GPU setting) runs."""
    for zero in ({"stage": stage, "offload_optimizer": {"device": "cpu"}}, {"stage": stage, "cpu_offload": True}):
        s = parse_deepspeed_config({"zero_optimization": zero})
        assert (s.zero_stage, s.cpu_offload) == (stage, True)
