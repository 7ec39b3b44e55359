"""Device time of a callable, shared by the check scripts (run as ``python benchmarks/NAME.py``)."""
import torch


def cuda_ms(fn, reps: int = 20) -> float:
    """Mean milliseconds per call over ``reps`` calls after 3 warm-up calls, by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
