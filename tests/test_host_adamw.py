"""benchmarks/host_adamw.py's worker-thread AdamW (the overlapped offload step's shape) runs beside what the
main thread does, and refuses an activity it does not know."""
from __future__ import annotations

import pytest
from bench_script import load


def test_adamw_on_a_worker_thread_beside_python():
    host_adamw = load("host_adamw")
    for beside in ("nothing", "python"):
        assert 0 < host_adamw.adamw_beside(64 * 1000, 1, beside, repeats=1)[0] < 60
    with pytest.raises(ValueError, match="beside"):
        host_adamw.adamw_beside(64 * 1000, 1, "sleep")
