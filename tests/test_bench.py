"""`gptrain bench` on a CPU: progress while it runs, n/a (not nan) for GPU memory, and the ratio
flagged as meaningful only on a GPU."""
from __future__ import annotations

import re

from gptrain.bench import bench_main
from tiny import TINY_FLAGS

TINY = TINY_FLAGS + ("--seq-length 32 --micro-batch-size 2 "
        "--hidden-dropout 0 --attention-dropout 0 --device cpu").split()


def test_bench_on_cpu_reports_progress_and_no_nan(capsys):
    assert bench_main(TINY + ["--warmup", "1", "--iters", "2", "--baseline-no-compile"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    lines = out.splitlines()
    progress = [line for line in lines if re.match(r"(gptrain|baseline): ", line)]
    assert progress[0] == "gptrain: building the model ..."
    assert "gptrain: 1 warm-up iterations (compilation happens here) ..." in progress
    assert any(re.match(r"gptrain: timing 2 iterations \(warm-up took [\d.]+ s\) \.\.\.$", x) for x in progress)
    assert any(re.match(r"baseline: [\d.]+ ms per iteration$", x) for x in progress)
    # progress comes before the table
    assert lines.index(progress[-1]) < next(i for i, x in enumerate(lines) if x.startswith("| what |"))
    rows = [line for line in lines if line.startswith(("| gptrain (train step)", "| baseline (plain PyTorch)"))]
    assert len(rows) == 2 and all(row.endswith("| n/a | n/a | n/a |") for row in rows)
    ratio = next(line for line in lines if line.startswith("gptrain / baseline tokens/s:"))
    assert re.match(r"gptrain / baseline tokens/s: [\d.]+x \(on cpu: .* means something only on a GPU\)$", ratio)
