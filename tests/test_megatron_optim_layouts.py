"""--load of megatron-core's fp32 torch_dist checkpoint with optimizer state (test_megatron_optim.py's run,
saved at TP1 x PP1) by gptrain running at tensor parallel 2 and at pipeline parallel 2: each rank takes its
slice of Adam's moments as the weights', so the next iteration's weights are megatron-core's next
iteration's, and the one after is the one-process import's (where the last pipeline stage's copy of the
tied embeddings, and its moments, take part in the forward)."""
from __future__ import annotations

import pytest
import torch

from distributed import torchrun
from test_megatron_optim import FLAGS, GLOBAL_BATCH, SAVED_AT, VOCAB, _gptrain_name, megatron_run  # noqa: F401

# Megatron pads the vocabulary to a multiple of 128 x TP: at TP2 a divisor of 64 keeps its 1152 rows, so
# --softmax-over-padded-vocab sums over the rows megatron-core's loss did
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
           "pp2": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"]}  # a pipeline needs 2
# two iterations past the checkpoint, saved after each; the lr decays over megatron-core's 3 iterations
CONTINUE = ["--softmax-over-padded-vocab", "--train-iters", "4", "--lr-decay-iters", "3", "--save-interval", "1"]


def _saved_weights(save, iteration: int) -> dict[str, torch.Tensor]:
    from gptrain.checkpoint_kind import TRACKER
    from gptrain.interop.convert import read_gptrain

    (save / TRACKER).write_text(str(iteration))  # read_gptrain reads the tracker's iteration
    model, state = read_gptrain(save)
    assert state["iteration"] == iteration and state["schedule"]["num_steps"] == iteration * GLOBAL_BATCH
    return {name: p.detach() for name, p in model.named_parameters()}


def _worst(ours: dict, theirs: dict) -> list:
    """The largest differences over the real vocabulary (gptrain's checkpoints keep those rows)."""
    assert sorted(ours) == sorted(theirs)
    worst = {name: (ours[name][:VOCAB] - theirs[name][:VOCAB]).abs().max().item() for name in ours}
    return sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.fixture(scope="module")
def one_process(megatron_run, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The one-process import's weights two iterations on (test_megatron_optim.py checks its first)."""
    from gptrain.train.run import train_main

    save, lines = tmp_path_factory.mktemp("one_process"), []
    assert train_main(FLAGS + CONTINUE + ["--load", str(megatron_run), "--save", str(save)],
                      log=lines.append).exit_code == 0, "\n".join(lines[-20:])
    return _saved_weights(save, SAVED_AT + 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_continues_as_megatron_core_would_at_two_ranks(megatron_run, one_process, layout, tmp_path):
    save = tmp_path / "save"
    out = torchrun(2, FLAGS + LAYOUTS[layout] + CONTINUE + ["--load", str(megatron_run), "--save", str(save)])
    loaded = [line for line in out.splitlines() if "loaded Megatron-LM checkpoint" in line]
    assert loaded and f"at iteration {SAVED_AT}" in loaded[0] and "optimizer state imported" in loaded[0], out[-3000:]
    megatron_next = {_gptrain_name(name): w for name, w in torch.load(megatron_run / "reference.pt")[
        "weights_after_next"].items()}
    worst = _worst(_saved_weights(save, SAVED_AT + 1), megatron_next)
    assert worst[0][1] <= 1e-6, worst
    worst = _worst(_saved_weights(save, SAVED_AT + 2), one_process)
    assert worst[0][1] <= 1e-6, worst
