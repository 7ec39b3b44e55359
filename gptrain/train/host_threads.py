"""The host's threads for --cpu-offload's AdamW. torchrun sets OMP_NUM_THREADS=1 in every worker when it
starts several on a node (its default, to keep the ranks' CPU work from overloading the host), which would
run each rank's offloaded optimizer on one core: a step's host AdamW over a few billion parameters then
takes seconds instead of a fraction of one (benchmarks/host_adamw.py measures the rate per thread count).
With offload, each rank takes its share of the cores it may run on instead; GPTRAIN_HOST_THREADS sets the
number outright."""
from __future__ import annotations

import os


def offload_threads(environ=os.environ, total: int | None = None, affinity: int | None = None) -> tuple[int, str] | None:
    """(threads, why) for this rank's offloaded optimizer, or None to leave torch's setting as it is.
    ``total``: the node's CPUs; ``affinity``: those this rank may run on (a launcher may bind each rank to
    its own), both read from the OS when not given."""
    chosen = environ.get("GPTRAIN_HOST_THREADS")
    if chosen:
        threads = int(chosen)
        if threads < 1:
            raise ValueError(f"GPTRAIN_HOST_THREADS={chosen}: give a number of threads of at least 1")
        return threads, "GPTRAIN_HOST_THREADS"
    local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    if environ.get("OMP_NUM_THREADS") != "1" or local <= 1:
        return None
    total = total or os.cpu_count() or 1
    if affinity is None and hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    threads = min(total // local, affinity or total)
    if threads <= 1:
        return None
    return threads, (f"{total} CPUs shared by {local} ranks on this node, instead of torchrun's OMP_NUM_THREADS=1; "
                     "GPTRAIN_HOST_THREADS sets it")
