"""--tp-overlap-halves (parallel/overlapped_halves.py): TP2 with the micro-batch in two interleaved halves trains
the one-process model's losses, eagerly and compiled, and with hidden dropout the same losses as TP2 without the
split; compiled, each half's block all-reduce has the other half's matmuls between its start and its wait (what
the split is for); the layouts it cannot run are refused in one line."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from distributed import TINY, _env, losses, single, torchrun
from gptrain.config import parse_megatron_args
from gptrain.train.build import parallel_dims

STEPS = ["--train-iters", "4"]
TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_halves_train_the_one_process_losses(compiled):
    reference = losses(single(TINY + STEPS))
    got = losses(torchrun(2, TINY + STEPS + TP2 + ["--tp-overlap-halves"] + (["--compile"] if compiled else []),
                          timeout=600))
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4]
    for it, loss in reference.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it


@pytest.mark.slow
def test_halves_draw_the_whole_micro_batchs_dropout_masks():
    i = TINY.index("--hidden-dropout")
    # attention dropout stays 0: its masks come from each rank's generator, drawn per half
    flags = TINY[:i] + TINY[i + 2:] + ["--hidden-dropout", "0.2"]
    straight = losses(torchrun(2, flags + STEPS + TP2))
    halves = losses(torchrun(2, flags + STEPS + TP2 + ["--tp-overlap-halves"]))
    assert sorted(halves) == [1, 2, 3, 4]
    for it, loss in straight.items():
        assert halves[it] == pytest.approx(loss, rel=1e-5), it


_CALL = re.compile(r"def call\(self, args\):")
_BUF = r"\(reinterpret_tensor\((buf\d+)|\((buf\d+)"


@pytest.mark.slow
def test_compiled_waits_come_after_the_other_halfs_matmuls(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gptrain",
           "train", *TINY, "--train-iters", "1", *TP2, "--tp-overlap-halves", "--compile"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**_env(), "TORCH_LOGS": "output_code"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("[rank0]")]
    start = next(i for i, line in enumerate(lines) if _CALL.search(line))  # the forward's code comes first
    end = next(i for i in range(start + 1, len(lines)) if _CALL.search(lines[i]))
    forward = lines[start:end]
    started: dict[str, int] = {}  # buffer -> matmuls issued since its all-reduce started
    between = []
    for line in forward:
        if "extern_kernels.mm(" in line or "extern_kernels.addmm(" in line:
            started = {b: n + 1 for b, n in started.items()}
        elif "all_reduce_.default(reinterpret_tensor(" in line:
            started[re.search(r"reinterpret_tensor\((buf\d+)", line).group(1)] = 0
        elif "gptrain.wait_after.default(" in line:
            buf = re.search(r"reinterpret_tensor\((buf\d+)", line).group(1)
            between.append(started.pop(buf))
    layers = 2
    assert len(between) == 4 * layers  # every block's two sums, for each half
    # the last block's last sum has nothing left beside it (the loss takes both halves); the first block's first
    # may see only the other half's projection; every other has more
    assert between[-1] == 0 and all(n >= 1 for n in between[:-1]), between
    assert sum(n >= 2 for n in between) >= len(between) - 2, between


@pytest.mark.parametrize("extra, message", [
    ([], "needs --tensor-model-parallel-size above 1"),
    (TP2 + ["--sequence-parallel"], "leave out --sequence-parallel"),
    (TP2 + ["--zero-stage", "3"], "tensor and data parallelism only"),
    (TP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "full recompute"),
    (TP2 + ["--micro-batch-size", "3", "--global-batch-size", "6"], "is odd"),
])
def test_layouts_it_cannot_run_are_refused(extra, message):
    world = 4 if "--zero-stage" in extra else 2
    cfg, _ = parse_megatron_args(TINY + STEPS + ["--tp-overlap-halves"] + extra, world_size=world)
    with pytest.raises(ValueError, match=f"--tp-overlap-halves: .*{re.escape(message)}"):
        parallel_dims(cfg, world)
