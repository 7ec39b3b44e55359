"""--overlap-grad-reduce's buckets over bf16 parameters' fp32 main gradients (parallel/grad_buckets.py with
MainParams.take_grads): over steps of several micro-batches, with a weight never used and one used in some
micro-batches only, the main gradients equal the plain path's (MainParams.accumulate_grads) bit for bit,
whatever the bucket size, and every bucket is reduced once a step."""
from __future__ import annotations

import torch

from distributed import spawn


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return self.c(self.b(h) if use_b else h).sum()


def _main_gradients(bucket_size, overlap: bool):
    import torch.distributed as dist

    from gptrain.parallel.grad_buckets import overlap_reduction
    from gptrain.train.main_params import MainParams

    torch.manual_seed(0)
    model = _Net()
    main = MainParams(model, torch.bfloat16)
    buckets = overlap_reduction([], main, dist.group.WORLD, 1, bucket_size, None) if overlap else None
    launches = []
    if buckets is not None:
        launch = buckets._launch
        buckets._launch = lambda b: (launches.append(b), launch(b))
    inputs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(4)]
    uses = [True, False, False, True]
    steps = []
    for _ in range(2):
        launches.clear()
        for i, (x, use) in enumerate(zip(inputs, uses)):
            if buckets is not None:
                buckets.arm(i == len(inputs) - 1)
            (model(x, use) / len(inputs)).backward()
            if buckets is None:
                main.accumulate_grads()
        if buckets is not None:
            buckets.wait()
            assert sorted(launches) == list(range(len(buckets.spans))), launches  # each bucket once a step
        steps.append(main.grad_flat.clone())
        for m in main.main:
            m.grad = None
        main.release_grads()
    return steps, None if buckets is None else len(buckets.spans)


def _compare(rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    plain, _ = _main_gradients(None, overlap=False)
    counts = set()
    for size in (None, 100, 10):
        overlapped, n = _main_gradients(size, overlap=True)
        counts.add(n)
        for a, b in zip(plain, overlapped):
            assert torch.equal(a, b), (size, (a - b).abs().max())
    assert len(counts) == 3, counts  # one bucket, a few, one a weight
    dist.destroy_process_group()


def test_bucketed_main_gradients_equal_the_plain_accumulation():
    spawn(1, _compare)
