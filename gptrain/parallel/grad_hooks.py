"""Hooks that run as autograd finishes accumulating each parameter's gradient, held weakly.

A post-accumulate-grad hook is kept by the parameter's C++ side, where Python's collector cannot see it: a
hook holding its owner strongly, while the owner holds the parameters, is a cycle the collector never
frees, and every model built in the process stays allocated (a GPU benchmark's rows, a test session). The
hooks registered here reach their owner through a weak reference and do nothing once it is gone.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch


def on_grad_accumulated(params: list[torch.Tensor], callback: Callable[[int], None]) -> None:
    """``callback(i)`` each time autograd has accumulated ``params[i]``'s gradient; ``callback`` a bound method,
    held weakly."""
    ref = weakref.WeakMethod(callback)

    def hook(i: int) -> None:
        fn = ref()
        if fn is not None:
            fn(i)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: hook(i))
