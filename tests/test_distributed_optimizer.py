"""parallel/distributed_optimizer.py: ZeRO-1 on whole replicas (Megatron's distributed optimizer) against plain
data parallelism (bitwise in bf16: the same sums, the same element-wise AdamW), against one process with rows
that do not split evenly over three ranks, and its checkpoints resumed at other layouts (gloo, CPU)."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY, losses, single, torchrun
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.train.checkpoint import load_checkpoint

ROWS = ["--use-distributed-optimizer"]


def _weights(ckpt_dir, argv) -> dict[str, torch.Tensor]:
    cfg, _ = parse_megatron_args(argv + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    load_checkpoint(ckpt_dir, dict(model.named_parameters()), None, cfg.model.vocab_size)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


@pytest.mark.slow
@pytest.mark.parametrize("reduce", [[], ["--grad-reduce-in-bf16"]], ids=["fp32-reduction", "bf16-reduction"])
def test_rows_equal_plain_data_parallel_bitwise_in_bf16(reduce, tmp_path):
    """Two micro-batches a step (the copy, then the add into the gradient buffer), bf16 parameters: the
    reduce-scatter sums what the all-reduce sums and AdamW is element-wise, so the losses and the saved
    weights are the same bits as plain data parallelism's."""
    run = TINY + ["--bf16", "--train-iters", "4"] + reduce
    plain = torchrun(2, run + ["--save", str(tmp_path / "dp")])
    rows = torchrun(2, run + ROWS + ["--save", str(tmp_path / "rows")])
    assert "as Megatron's distributed optimizer" in _line(rows, " > parameters:")
    assert "all-reduced" in _line(plain, " > parameters:")
    assert losses(rows) == losses(plain) and sorted(losses(rows)) == [1, 2, 3, 4]
    a, b = _weights(tmp_path / "dp", TINY), _weights(tmp_path / "rows", TINY)
    assert all(torch.equal(a[k], b[k]) for k in a)


UNEVEN = TINY + ["--micro-batch-size", "1", "--global-batch-size", "6", "--lr-decay-iters", "5"]


@pytest.mark.slow
def test_uneven_rows_over_three_ranks_equal_one_process_and_resume_elsewhere(tmp_path):
    """Hidden size 32 over three ranks: rows of 11, 11 and 10 (the last block padded). The same losses and
    weights as one process; its checkpoint (iteration 3) resumes at two ranks of the distributed optimizer
    and in one process with the straight run's next losses."""
    straight = single(UNEVEN + ["--train-iters", "5", "--save", str(tmp_path / "one")])
    three = torchrun(3, UNEVEN + ROWS + ["--train-iters", "5", "--save", str(tmp_path / "three")])
    ref, got = losses(straight), losses(three)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for it, loss in ref.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    # summed in another order over three ranks: Adam turns the rounding of near-zero gradients (a few word
    # embedding rows, the key bias) into differences of up to 1e-5 after 5 steps, as in test_tensor_parallel.py
    a, b = _weights(tmp_path / "one", TINY), _weights(tmp_path / "three", TINY)
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, rtol=1e-5, atol=2e-5, msg=name)

    torchrun(3, UNEVEN + ROWS + ["--train-iters", "5", "--exit-interval", "3", "--save", str(tmp_path / "ck")])
    for resume in (lambda argv: torchrun(2, argv + ROWS), single):
        out = resume(UNEVEN + ["--train-iters", "5", "--load", str(tmp_path / "ck")])
        resumed = losses(out)
        assert sorted(resumed) == [4, 5]
        for it in (4, 5):
            assert resumed[it] == pytest.approx(ref[it], rel=1e-5), (it, resumed, ref)
