"""benchmarks/host_adamw.py's worker-thread AdamW (the overlapped offload step's shape) runs beside what the
main thread does, and refuses an activity it does not know; the main thread's rate beside it, on plain tensors
and DTensors."""
from __future__ import annotations

import pytest
from bench_script import load


def test_adamw_on_a_worker_thread_beside_python():
    host_adamw = load("host_adamw")
    for beside in ("nothing", "python"):
        assert 0 < host_adamw.adamw_beside(64 * 1000, 1, beside, repeats=1)[0] < 60
    with pytest.raises(ValueError, match="beside"):
        host_adamw.adamw_beside(64 * 1000, 1, "sleep")


def test_the_main_threads_calls_beside_a_worker_adamw_on_plain_tensors_and_dtensors():
    host_adamw = load("host_adamw")
    for through in ("nothing", "plain", "dtensor"):
        assert host_adamw.main_thread_rate(4 * 1000, 1, through, seconds=0.05) > 0
    import torch.distributed as dist

    assert not dist.is_initialized()  # the one-rank group it made for the DTensors is gone


def test_the_streaming_bandwidth_beside_the_adamw_rate():
    host_adamw = load("host_adamw")
    assert host_adamw.stream_gbps(1 << 16, 1, repeats=1) > 0
