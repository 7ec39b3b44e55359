"""The whole step compiled once but cut where the gradient buckets end (``--overlap-grad-reduce``):
torch's DDPOptimizer, the graph splitter ``torch.compile`` uses under ``DistributedDataParallel``,
as the backend of gptrain's own step. It walks the forward graph from its end and starts a new
subgraph once the parameters used since the last cut hold about a bucket's bytes, then compiles
each subgraph with Inductor (the run's ``--compile-mode``). Each subgraph's backward is its own
autograd node, so the gradients of the last layers reach their post-accumulate-grad hooks
(parallel/grad_buckets.py) and their all-reduce starts while the earlier layers' backward runs;
one graph would hand every gradient over at its end. A few cuts cost far less fusion than
compiling each block alone (the earlier route: RESULTS.md, "Overlapped data-parallel reduction")."""
from __future__ import annotations

import functools

import torch


def compile_in_buckets(module: torch.nn.Module, mode: str | None, bucket_bytes: int):
    """``module`` compiled as graphs of about ``bucket_bytes`` of parameters each (its ``splitter``
    attribute holds the cuts made, once the first call has compiled it)."""
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = list_mode_options(mode) if mode else {}
    inner = functools.partial(compile_fx, config_patches=options) if options else compile_fx
    # the first bucket as large as the others: DDP's small first bucket (1 MiB) would cut the output layer off
    splitter = DDPOptimizer(bucket_bytes_cap=bucket_bytes, backend_compile_fn=inner, first_bucket_cap=bucket_bytes)
    compiled = torch.compile(module, backend=splitter.compile_fn)
    compiled.splitter = splitter
    return compiled
