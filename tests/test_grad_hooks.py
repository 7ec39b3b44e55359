"""parallel/grad_hooks.py: the gradient-arrival hooks call their owner while it lives, and do not keep it (nor
the model it holds) alive: a strong hook would be a cycle through the parameters' C++ side that Python's
collector never frees (a layout table's earlier rows stayed allocated on the GPU)."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

from gptrain.parallel.grad_hooks import on_grad_accumulated
from gptrain.train.main_params import MainParams


class _Owner:
    def __init__(self, params):
        self.params, self.seen = params, []
        on_grad_accumulated(params, self.arrived)

    def arrived(self, i: int) -> None:
        self.seen.append(i)


def test_the_hooks_report_each_gradient_and_keep_nothing_alive():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    owner = _Owner(params)
    model(torch.randn(3, 4)).sum().backward()
    assert sorted(owner.seen) == [0, 1, 2, 3]
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None
    model(torch.randn(3, 4)).sum().backward()  # the hooks outlive their owner harmlessly


def test_a_pipeline_stage_main_params_and_model_are_freed():
    """MainParams.accumulate_on_backward (a pipeline's fp32 accumulation) takes each gradient as it arrives, and
    once the run drops the model and its main copies, both are freed."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    main = MainParams(model, torch.bfloat16)
    main.accumulate_on_backward()
    for _ in range(2):
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert all(p.grad is None for p in model.parameters())  # taken into the fp32 main gradients
    assert main.grad_flat is not None and main.grad_flat.abs().sum() > 0
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(main)]
    del model, main
    gc.collect()
    assert all(r() is None for r in refs)
