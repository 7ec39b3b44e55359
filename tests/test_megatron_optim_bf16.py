"""--load of a bf16 Megatron-LM run's torch_dist checkpoint: megatron-core's Float16OptimizerWithFloat16Params
(fp32 main weights beside the moments) and its distributed optimizer in Megatron-LM's default
dp_reshardable format (flat buffers) and in fully_reshardable (per parameter), each written by megatron-core itself (tests/megatron_core_optim.py).
gptrain imports the fp32 main weights, moments and step bit for bit, and its next iteration gives
megatron-core's next main weights within bf16 arithmetic's differences (below)."""
from __future__ import annotations

import pytest
import torch

from test_megatron_optim import FLAGS, GLOBAL_BATCH, SAVED_AT, VOCAB, _config, _gptrain_name, _megatron_core_run

FORMATS = {"bf16": ("Float16OptimizerWithFloat16Params", {"precision": "bf16"}),
           "distributed": ("distributed optimizer, dp_reshardable", {"precision": "bf16",
                                                                     "distributed": "dp_reshardable"}),
           "fully_reshardable": ("distributed optimizer, fully_reshardable",
                                 {"precision": "bf16", "distributed": "fully_reshardable"})}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def bf16_run(request, tmp_path_factory):
    source, run = FORMATS[request.param]
    return _megatron_core_run(tmp_path_factory.mktemp(request.param), **run), source


def _load(folder, *flags):
    from gptrain.model.gpt import GPT
    from gptrain.train.build import build_optimizer
    from gptrain.train.checkpoint import init_optimizer_state
    from gptrain.train.megatron_load import load_megatron

    cfg = _config(*flags)
    params = dict(GPT(cfg.model).named_parameters())  # fp32: what gptrain's optimizer updates (main copies)
    optimizer = build_optimizer(params, cfg)
    init_optimizer_state(params, optimizer)
    return params, optimizer, load_megatron(folder, params, cfg, optimizer=optimizer)


def test_main_weights_moments_and_step_are_megatron_cores(bf16_run):
    folder, source = bf16_run
    params, optimizer, state = _load(folder, "--bf16")
    reference = torch.load(folder / "reference.pt")["optimizer_state"]
    assert sorted(map(_gptrain_name, reference)) == sorted(params)
    for megatron_name, theirs in reference.items():
        ours = params[_gptrain_name(megatron_name)]
        assert torch.equal(ours, theirs["fp32_param"]), megatron_name  # not the bf16 weights re-widened
        assert int(optimizer.state[ours]["step"]) == int(theirs["step"]) == SAVED_AT
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[ours][moment], theirs[moment]), (megatron_name, moment)
    assert state["optimizer"] == (f"optimizer state imported ({source}: fp32 main weights, Adam's moments, step "
                                  f"{SAVED_AT}); lr schedule at {SAVED_AT * GLOBAL_BATCH} samples")


def test_an_fp32_run_takes_the_main_weights(bf16_run):
    folder, _ = bf16_run
    params, _, state = _load(folder)
    reference = torch.load(folder / "reference.pt")["optimizer_state"]
    assert all(torch.equal(params[_gptrain_name(n)], s["fp32_param"]) for n, s in reference.items())
    assert "; the checkpoint is a bf16 run's: its fp32 main weights become this fp32 run's weights" in state["optimizer"]


def _without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """The QKV bias's key rows have no gradient in exact arithmetic (softmax ignores a shift common to all
    keys): each side's is rounding noise, which Adam turns into steps of about lr either way."""
    if name.endswith("linear_qkv.bias"):
        t = t.view(4, 3, -1)[:, [0, 2]]  # [heads, (q, k, v), head_dim]: q and v rows
    return t.reshape(-1)


def test_training_continues_as_megatron_core_would(bf16_run, tmp_path):
    """One more bf16 iteration in gptrain from the import against megatron-core's next iteration, on the fp32
    main weights after it. Both compute the step's gradients in bf16 with different kernels, so gradients
    differ in bf16's last bits; Adam's update, normalised per element, carries that over: per tensor the
    difference is at most 5% of the update's size (measured 2.4% at worst, most near 0.5%). That is far
    below what continuing from the bf16 weights instead of the main weights would give (their rounding
    alone is 3x the update for the LayerNorm weights, 7-10% for the matrices): checked overall, 10x."""
    from gptrain.interop.convert import read_gptrain
    from gptrain.train.run import train_main

    folder, _ = bf16_run
    lines = []
    rc = train_main(FLAGS + ["--bf16", "--load", str(folder), "--save", str(tmp_path / "save"),
                             "--softmax-over-padded-vocab"], log=lines.append).exit_code
    assert rc == 0, "\n".join(lines)
    assert any("fp32 main weights, Adam's moments" in line for line in lines if "loaded Megatron-LM" in line)
    model, state = read_gptrain(tmp_path / "save")
    assert state["iteration"] == SAVED_AT + 1
    ours = dict(model.named_parameters())
    reference = torch.load(folder / "reference.pt")
    differences, roundings = [], []
    for megatron_name, theirs in reference["weights_after_next"].items():
        rows = VOCAB if "word_embeddings" in megatron_name else None
        before = reference["optimizer_state"][megatron_name]["fp32_param"][:rows]
        mine = ours[_gptrain_name(megatron_name)][:rows].float()
        difference, update = (_without_key_bias(megatron_name, t) for t in (mine - theirs[:rows], theirs[:rows] - before))
        assert difference.norm() <= 0.05 * update.norm(), (megatron_name, difference.norm() / update.norm())
        assert (mine - theirs[:rows]).abs().max() <= 2 * reference["next_lr"], megatron_name  # key bias included
        differences.append(difference)
        roundings.append(_without_key_bias(megatron_name, theirs[:rows].bfloat16().float() - theirs[:rows]))
    assert torch.cat(differences).norm() < torch.cat(roundings).norm() / 10


def test_a_format_not_imported_loads_the_weights_with_a_fresh_optimizer(bf16_run, monkeypatch):
    from gptrain.interop import megatron_optim

    def refuse(folder):
        raise megatron_optim.OptimizerNotImported("the distributed optimizer's dp_zero_gather_scatter format is not read")
    monkeypatch.setattr(megatron_optim, "read_optimizer_state", refuse)
    folder, _ = bf16_run
    _, optimizer, state = _load(folder, "--bf16")
    assert state["scheduler"] is None and state["iteration"] == SAVED_AT
    assert state["optimizer"] == ("optimizer state not imported (the distributed optimizer's dp_zero_gather_scatter "
                                  "format is not read): the optimizer starts fresh")
