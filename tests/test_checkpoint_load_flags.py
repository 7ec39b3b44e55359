"""--finetune (weights only), --no-load-optim (Megatron's meaning: optimizer, lr schedule and loss
scale fresh), --no-load-rng, read back from the checkpoints the runs write."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY, losses
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.train.checkpoint import load_checkpoint
from gptrain.train.checkpoint_files import read_tracker
from gptrain.train.run import train_main

RUN = TINY + ["--lr-decay-iters", "6"]


def _train(argv):
    lines: list[str] = []
    rc = train_main(argv, log=lines.append).exit_code
    assert rc == 0, lines[-5:]
    return lines


def _read(ck):
    """Weights, AdamW state and the saved state of a checkpoint, in one plain model."""
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values())
    state = load_checkpoint(ck, params, optimizer, cfg.model.vocab_size, load_rng=False)
    step = optimizer.state[params["layers.0.attn.qkv.weight"]]["step"].item()
    return {k: v.detach().clone() for k, v in params.items()}, step, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ck = tmp_path_factory.mktemp("ck") / "ck"
    _train(RUN + ["--train-iters", "4", "--save", str(ck)])
    return ck


def test_finetune_loads_weights_only(saved, tmp_path):
    lines = _train(RUN + ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--load", str(saved), "--finetune",
                          "--save", str(tmp_path / "ft")])
    assert f" loaded weights from {saved} (iteration 4); --finetune starts at 0" in lines
    assert sorted(losses("\n".join(lines))) == [1]  # iteration numbering restarted
    before, _, _ = _read(saved)
    after, step, state = _read(tmp_path / "ft")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the loaded weights (lr 0 kept them)
    assert step == 1 and state["iteration"] == 1 and state["consumed_train_samples"] == 8


def test_no_load_optim_keeps_the_iteration_and_starts_the_optimizer_fresh(saved, tmp_path):
    lines = _train(RUN + ["--train-iters", "5", "--load", str(saved), "--no-load-optim", "--save", str(tmp_path / "n")])
    assert " > --no-load-optim: optimizer state, learning-rate schedule and loss scale start fresh" in lines
    assert sorted(losses("\n".join(lines))) == [5]
    line = next(x for x in lines if x.startswith(" iteration        5/"))
    assert "learning rate: 3.000E-03 |" in line  # the warm-up's first step again (--lr-warmup-iters 1), as Megatron
    _, step, state = _read(tmp_path / "n")
    assert step == 1 and state["iteration"] == 5 and read_tracker(tmp_path / "n") == 5
    _, loaded_step, _ = _read(saved)
    assert loaded_step == 4


def test_no_load_rng_leaves_the_generators_alone(saved):
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    torch.manual_seed(99)
    mine = torch.get_rng_state()
    load_checkpoint(saved, dict(model.named_parameters()), None, cfg.model.vocab_size, load_rng=False)
    assert torch.equal(torch.get_rng_state(), mine)
    load_checkpoint(saved, dict(model.named_parameters()), None, cfg.model.vocab_size, load_rng=True)
    restored = torch.get_rng_state()
    assert not torch.equal(restored, mine)
    from safetensors.torch import load_file
    assert torch.equal(restored, load_file(saved / "iter_0000004" / "rng_rank00000.safetensors")["torch_cpu"])
