"""A checkpoint saved by one process resumes at another layout (tensor parallel 2, ZeRO-3 over two
data-parallel ranks, the distributed optimizer's rows over two) with the next losses of the straight run (fp32, CPU, gloo). The reverse
direction (TP2 -> one process) is in test_tensor_parallel.py."""
from __future__ import annotations

import pytest

from distributed import TINY, losses, torchrun
from gptrain.train.run import train_main

RUN = TINY + ["--lr-decay-iters", "6"]  # one schedule for the 4-iteration save and the 6-iteration runs


@pytest.fixture(scope="module")
def saved_by_one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    lines: list[str] = []
    assert train_main(RUN + ["--train-iters", "6"], log=lines.append).exit_code == 0
    assert train_main(RUN + ["--train-iters", "4", "--save", str(root / "ck")], log=lambda s: None).exit_code == 0
    straight = losses("\n".join(lines))
    return straight, root / "ck"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--zero-stage", "3"],
                                    ["--use-distributed-optimizer"]],
                         ids=["tp2", "zero3-dp2", "distributed-optimizer-dp2"])
def test_one_process_checkpoint_resumes_at_another_layout(layout, saved_by_one_process):
    straight, ck = saved_by_one_process
    out = torchrun(2, RUN + layout + ["--train-iters", "6", "--load", str(ck)])
    assert f"successfully loaded checkpoint from {ck} at iteration 4" in out
    resumed = losses(out)
    assert sorted(resumed) == [5, 6]
    for it in (5, 6):
        assert resumed[it] == pytest.approx(straight[it], rel=1e-4), (it, resumed, straight)
