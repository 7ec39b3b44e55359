"""benchmarks/layout_table.py: every layout's step one after another in the same two processes. A row leaves nothing
behind that changes the next (the same layout again trains to the same losses), every layout trains the one-process
model (fp32, the same global batch), nanoGPT's step runs beside the rows it anchors, --time-limit stops new rows on
every rank alike, and a one-GPU row that would need a group of its own is refused before anything runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench_script import load
from distributed import TINY, _env

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "layout_table.py"
ROWS = ["1gpu:1:2:4:", "dp2:2:2:4:", "tp:2:2:4:--tensor-model-parallel-size 2",
        "pp:2:1:4:--pipeline-model-parallel-size 2", "zero3:2:2:4:--zero-stage 3",
        "tp_sp:2:2:4:--tensor-model-parallel-size 2 --sequence-parallel", "overlap:2:2:4:--overlap-grad-reduce",
        "tp_again:2:2:4:--tensor-model-parallel-size 2", "1gpu_again:1:2:4:"]


def _table(extra: list[str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--rows", "", "--warmup", "1", "--iters", "2", *extra, "--", *TINY]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def _final_rows(out: str) -> dict[str, list[str]]:
    final = out[out.index("== the table"):]
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in final.splitlines() if line.startswith("| ")
                                          and not line.startswith(("| row ", "| ---")))}


@pytest.mark.slow
def test_every_layout_trains_the_same_model_one_row_after_another():
    out = _table([x for r in ROWS for x in ("--row", r)])
    rows = _final_rows(out)
    assert list(rows) == ["1gpu", "1gpu_again", "dp2", "tp", "pp", "zero3", "tp_sp", "overlap", "tp_again"]  # 1 GPU first
    loss = {name: float(cells[11]) for name, cells in rows.items()}
    assert loss["tp_again"] == loss["tp"] and loss["1gpu_again"] == loss["1gpu"]
    assert all(v == pytest.approx(loss["1gpu"], rel=1e-5) for v in loss.values()), loss
    assert rows["1gpu"][7] == "100.0%" and re.fullmatch(r"\d+\.\d%", rows["tp"][7])  # of the first one-GPU row
    assert all(re.fullmatch(r"[\d.]+ \([\d.]+\)", cells[5]) for cells in rows.values())  # host ms/iter (in gc)
    # nanoGPT beside the rows it anchors, and only there
    assert [name for name, cells in rows.items() if cells[12]] == ["1gpu", "dp2"]
    assert re.fullmatch(r"[\d.]+ ms, [\d,]+", rows["dp2"][12])
    assert rows["dp2"][13] == ""  # no GPU memory to have been left behind
    assert re.fullmatch(r"build \d+, steps \d+, baseline \d+", rows["dp2"][14])


@pytest.mark.slow
def test_no_row_starts_after_the_time_limit():
    out = _table(["--no-baseline", "--time-limit", "0", "--row", "1gpu:1:2:4:", "--row", "dp2:2:2:4:"])
    assert "not run (--time-limit 0 s): 1gpu dp2" in out
    assert _final_rows(out) == {}


def test_a_one_gpu_row_needing_its_own_group_is_refused(capsys):
    table = load("layout_table")
    assert table.main(["--rows", "", "--row", "offload:1:2:4:--zero-stage 3 --cpu-offload", "--", *TINY]) == 2
    assert "one-GPU rows offload need a process group of their own (--cpu-offload)" in capsys.readouterr().err


class _Buckets:  # stands in for a trainer's part that outlives its row
    def __init__(self, flat):
        self.flat = flat

    def arrived(self, i: int) -> None:
        """A hook's body: the test needs only the bound method, held where a hook would be."""


def test_holder_chain_names_what_keeps_a_tensor_alive_up_to_its_module():
    import types

    import torch

    table = load("layout_table")
    registry = types.ModuleType("registry_for_the_test")
    leaked = torch.zeros(4)
    registry.hooks = [_Buckets(leaked).arrived]  # a bound method kept in a module-level list, as a hook would be
    sys.modules[registry.__name__] = registry
    try:  # this frame left out: before Python 3.11 gc sees a running function's locals
        chain = table.holder_chain(leaked, ignore={id(sys._getframe())})
        unrooted = table.holder_chain(torch.zeros(1), max_depth=2)
    finally:
        del sys.modules[registry.__name__]
    assert chain.split(" <- ") == ["Tensor", "_Buckets", "method _Buckets.arrived", "list", "dict",  # its globals
                                   "module registry_for_the_test"], chain
    assert unrooted.endswith("(no module, thread or class within 2 links)"), unrooted
