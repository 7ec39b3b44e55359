"""train/host_threads.py: with --cpu-offload each rank's host AdamW gets its share of the node's CPUs where
torchrun's default OMP_NUM_THREADS=1 would leave it one core; GPTRAIN_HOST_THREADS decides outright."""
from __future__ import annotations

import pytest

from gptrain.train.host_threads import offload_threads


def test_torchruns_single_thread_default_becomes_the_ranks_share_of_the_cpus():
    threads, why = offload_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "4"}, total=64, affinity=64)
    assert threads == 16 and "64 CPUs shared by 4 ranks" in why
    # a launcher that bound each rank to its own 8 CPUs: those 8, not a quarter of them
    assert offload_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "4"}, total=64, affinity=8)[0] == 8


@pytest.mark.parametrize("environ", [
    {},  # one process, no torchrun: torch's own default (every core)
    {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"},  # one rank: the user chose one thread
    {"OMP_NUM_THREADS": "8", "LOCAL_WORLD_SIZE": "4"},  # the user's own setting
    {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"},  # no more than one CPU each anyway (8 CPUs)
])
def test_left_alone_elsewhere(environ):
    assert offload_threads(environ, total=8, affinity=8) is None


def test_gptrain_host_threads_decides():
    assert offload_threads({"GPTRAIN_HOST_THREADS": "6", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "4"},
                           total=64) == (6, "GPTRAIN_HOST_THREADS")
    with pytest.raises(ValueError, match="GPTRAIN_HOST_THREADS=0"):
        offload_threads({"GPTRAIN_HOST_THREADS": "0"})
