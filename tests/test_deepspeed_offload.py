"""benchmarks/deepspeed_offload.py, DeepSpeed's ZeRO-Offload reference: its model (bench's baseline module
with each block recomputed) equals the module without recompute (the same loss and gradients), its
DeepSpeed config is the issue's layout, and without deepspeed it runs nothing."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from bench_script import load

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed_offload.py"


def _module():
    return load("deepspeed_offload")


def test_recomputed_model_equals_the_baseline():
    from gptrain.bench_models import BaselineGPT

    torch.manual_seed(0)
    plain = BaselineGPT(128, 16, 32, 4, 2)
    recomputed = BaselineGPT(128, 16, 32, 4, 2, recompute=True)
    recomputed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 128, (3, 17))
    losses = []
    for model in (plain, recomputed):
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)


def test_the_config_is_zero_offload():
    args = argparse.Namespace(micro_batch_size=8, micro_batches=1, zero_stage=2, offload_ratio=1.0)
    cfg = _module().ds_config(args)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["bf16"] == {"enabled": True} and cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["gradient_clipping"] == 1.0
    # ZeRO-Offload++'s partial offload (deepspeed_z3_r50): the ratio at ZeRO-3
    args = argparse.Namespace(micro_batch_size=8, micro_batches=1, zero_stage=3, offload_ratio=0.5)
    zero = _module().ds_config(args)["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5}


def test_without_deepspeed_nothing_runs():
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here: the message is for machines without it")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "nothing run" in out.stdout
