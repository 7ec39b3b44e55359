"""--load of a Megatron-LM legacy ``--ckpt-format torch`` checkpoint with its optimizer state: megatron-core
itself (tests/megatron_core_optim.py) trains two iterations, fp32 (FP32Optimizer) and fp16
(Float16OptimizerWithFloat16Params with its DynamicGradScaler), and saves ``mp_rank_00/model_optim_rng.pt``
as Megatron-LM's generate_state_dict does. gptrain rebuilds the integer-indexed Adam state's parameter
order, imports moments, step, fp32 main weights, the lr schedule and the fp16 loss scale bit for bit, and
its next iteration gives megatron-core's. A torch_dist fp16 checkpoint's loss scale (its common state's
grad_scaler) is imported too."""
from __future__ import annotations

import pytest
import torch

from test_megatron_optim import FLAGS, GLOBAL_BATCH, SAVED_AT, VOCAB, _config, _gptrain_name, _megatron_core_run
from test_megatron_optim_bf16 import _load, _without_key_bias

LOSS_SCALE = {"initial_loss_scale": 4096.0, "loss_scale_window": 1000, "hysteresis": 2}
RUNS = {"fp32": ("FP32Optimizer", {"format": "torch"}),
        "fp16": ("Float16OptimizerWithFloat16Params", {"format": "torch", "precision": "fp16",
                                                       "loss_scale": LOSS_SCALE})}


@pytest.fixture(scope="module", params=sorted(RUNS))
def legacy_run(request, tmp_path_factory):
    source, run = RUNS[request.param]
    return _megatron_core_run(tmp_path_factory.mktemp(request.param), **run), request.param, source


def test_adam_state_main_weights_and_loss_scale_are_megatron_cores(legacy_run):
    folder, precision, source = legacy_run
    flags = ["--fp16"] if precision == "fp16" else []
    params, optimizer, state = _load(folder, *flags)
    reference = torch.load(folder / "reference.pt")
    assert sorted(map(_gptrain_name, reference["optimizer_state"])) == sorted(params)
    for megatron_name, theirs in reference["optimizer_state"].items():
        ours = params[_gptrain_name(megatron_name)]
        if precision == "fp16":
            assert torch.equal(ours, theirs["fp32_param"]), megatron_name
        assert int(optimizer.state[ours]["step"]) == int(theirs["step"]) == SAVED_AT
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[ours][moment], theirs[moment]), (megatron_name, moment)
    assert state["iteration"] == SAVED_AT and state["scheduler"]["num_steps"] == SAVED_AT * GLOBAL_BATCH
    what = "fp32 main weights, Adam's moments" if precision == "fp16" else "Adam's moments"
    expected = f"optimizer state imported ({source}, --ckpt-format torch: {what}, step {SAVED_AT})"
    if precision == "fp16":
        scaler = reference["grad_scaler"][0]
        assert state["loss_scale"] == {"scale": float(scaler["scale"]), "growth_tracker": scaler["growth_tracker"],
                                       "hysteresis_tracker": scaler["hysteresis_tracker"]}
        expected += "; loss scale 4096 (growth tracker 2, hysteresis tracker 2) from the checkpoint"
    else:
        assert state["loss_scale"] is None
    assert state["optimizer"] == expected + f"; lr schedule at {SAVED_AT * GLOBAL_BATCH} samples"


def test_training_continues_as_megatron_core_would(legacy_run, tmp_path):
    """One more gptrain iteration from the import against megatron-core's: fp32 within 1e-6 as the
    torch_dist import (test_megatron_optim.py); fp16 within 5% of the update per tensor as bf16's
    (test_megatron_optim_bf16.py: half-precision gradients from different kernels), the loss scale
    going on from Megatron's (one more clean step on its growth tracker)."""
    from gptrain.interop.convert import read_gptrain
    from gptrain.train.run import train_main

    folder, precision, _ = legacy_run
    flags = ["--fp16"] if precision == "fp16" else []
    lines = []
    rc = train_main(FLAGS + flags + ["--load", str(folder), "--save", str(tmp_path / "save"),
                                     "--softmax-over-padded-vocab"], log=lines.append).exit_code
    assert rc == 0, "\n".join(lines)
    assert any("optimizer state imported" in line for line in lines if "loaded Megatron-LM" in line)
    model, state = read_gptrain(tmp_path / "save")
    assert state["iteration"] == SAVED_AT + 1 and state["schedule"]["num_steps"] == (SAVED_AT + 1) * GLOBAL_BATCH
    ours = dict(model.named_parameters())
    reference = torch.load(folder / "reference.pt")
    for megatron_name, theirs in reference["weights_after_next"].items():
        rows = VOCAB if "word_embeddings" in megatron_name else None
        mine = ours[_gptrain_name(megatron_name)][:rows].float()
        if precision == "fp32":
            assert (mine - theirs[:rows]).abs().max() <= 1e-6, megatron_name
            continue
        before = reference["optimizer_state"][megatron_name]["fp32_param"][:rows]
        difference, update = (_without_key_bias(megatron_name, t) for t in (mine - theirs[:rows], theirs[:rows] - before))
        assert difference.norm() <= 0.05 * update.norm(), (megatron_name, difference.norm() / update.norm())
    if precision == "fp16":
        after = reference["grad_scaler"][1]
        assert state["scaler"] == {"scale": float(after["scale"]), "growth_tracker": after["growth_tracker"],
                                   "hysteresis_tracker": after["hysteresis_tracker"]}


@pytest.mark.parametrize("legacy_run", ["fp16"], indirect=True)
def test_a_static_loss_scale_keeps_its_own(legacy_run):
    folder, precision, _ = legacy_run
    _, _, state = _load(folder, "--fp16", "--loss-scale", "128")
    assert state["loss_scale"] is None and "the checkpoint's loss scale is not used (--loss-scale)" in state["optimizer"]


@pytest.mark.parametrize("legacy_run", ["fp32"], indirect=True)
def test_a_parameter_order_not_rebuilt_loads_a_fresh_optimizer(legacy_run, tmp_path):
    """Groups that do not match megatron-core's grouping (here: the no-weight-decay group first, lengths
    swapped) are refused with the reason, and the weights still load."""
    import shutil

    folder, _, _ = legacy_run
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / f"iter_{SAVED_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)  # the test's own file, written by megatron-core above
    for group in sd["optimizer"]["param_groups"]:
        group["wd_mult"] = 1.0 - group["wd_mult"]
    torch.save(sd, path)
    params, _, state = _load(copy)
    assert state["scheduler"] is None and state["iteration"] == SAVED_AT
    assert state["optimizer"].startswith("optimizer state not imported (a param group of 10 parameters, the "
                                         "model's has 18 (megatron-core's grouping not recognised))")
    assert state["optimizer"].endswith(": the optimizer starts fresh")


@pytest.fixture(scope="module")
def fp16_torch_dist_run(tmp_path_factory):
    return _megatron_core_run(tmp_path_factory.mktemp("fp16_dist"), precision="fp16", loss_scale=LOSS_SCALE)


def test_a_torch_dist_fp16_checkpoints_loss_scale_comes_along(fp16_torch_dist_run):
    """megatron-core keeps Float16OptimizerWithFloat16Params' grad_scaler in torch_dist's common state."""
    params, optimizer, state = _load(fp16_torch_dist_run, "--fp16")
    reference = torch.load(fp16_torch_dist_run / "reference.pt")
    scaler = reference["grad_scaler"][0]
    assert state["loss_scale"] == {"scale": float(scaler["scale"]), "growth_tracker": scaler["growth_tracker"],
                                   "hysteresis_tracker": scaler["hysteresis_tracker"]}
    for megatron_name, theirs in reference["optimizer_state"].items():
        assert torch.equal(params[_gptrain_name(megatron_name)], theirs["fp32_param"]), megatron_name
    assert state["optimizer"] == (f"optimizer state imported (Float16OptimizerWithFloat16Params: fp32 main weights, "
                                  f"Adam's moments, step {SAVED_AT}); loss scale 4096 (growth tracker 2, hysteresis "
                                  f"tracker 2) from the checkpoint; lr schedule at {SAVED_AT * GLOBAL_BATCH} samples")


@pytest.mark.parametrize("legacy_run", ["fp32"], indirect=True)
def test_apex_fused_adams_step_in_the_param_groups_is_read(legacy_run, tmp_path):
    """2021-2022 Megatron-LM ran apex's FusedAdam, which keeps the step in each param group."""
    import shutil

    folder, _, _ = legacy_run
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / f"iter_{SAVED_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)  # the test's own file, written by megatron-core above
    for state in sd["optimizer"]["state"].values():
        del state["step"]
    for group in sd["optimizer"]["param_groups"]:
        group["step"] = SAVED_AT
    torch.save(sd, path)
    params, optimizer, state = _load(copy)
    assert state["optimizer"].startswith(f"optimizer state imported (FP32Optimizer, --ckpt-format torch: Adam's "
                                         f"moments, step {SAVED_AT})")
    assert all(int(optimizer.state[p]["step"]) == SAVED_AT for p in params.values())
