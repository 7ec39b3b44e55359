"""Sequence parallelism's regions between two GPUs with the collectives made of copy-engine trades
(parallel/peer_swap.py) and split in halves under the matmuls (``--tp-comm-copy-engine --sequence-parallel``).

Each rank holds half of the micro-batch's tokens (rank 0 the first half). A region's entry all-gathers them: this
rank sends its half while it multiplies it, then multiplies the half it received. A region's exit
reduce-scatters the partial sums: this rank multiplies the other's half first and sends it while it multiplies
its own, then adds what it received. The backward passes do the same the other way round. With two ranks an
all-gather or a reduce-scatter is one trade of half the tokens each way; the matmuls keep the SMs (the copy
engines move the data) and NCCL's kernels are not involved.

Each function below is one custom op: ``torch.compile`` keeps it whole, and CUDA graphs capture the side stream's
fork and join inside it. Rows are tokens: x (tokens x in), w (out x in) as nn.Linear holds it, outputs over both
halves in rank order.
"""
from __future__ import annotations

import torch

from gptrain.kernels.ops import (linear_bias_gelu_into, linear_dgelu_into, linear_dgrad, linear_dgrad_into,
                                 linear_fwd, linear_fwd_into, linear_matmuls, linear_wgrad)
from gptrain.parallel.peer_swap import GATHER, SCATTER, rank_in, start_trade


def _halves(rank: int, n: int) -> tuple[slice, slice]:
    """(this rank's rows, the other's) of a tensor over both halves."""
    first, second = slice(0, n), slice(n, 2 * n)
    return (first, second) if rank == 0 else (second, first)


def _gather_into(x: torch.Tensor, group: str, each_half) -> torch.Tensor:
    """The all-gather of ``x`` (this rank's tokens) under ``each_half(rows, slice)``, called for this rank's half
    while it travels, then for the other's as it landed: returns the gathered tokens, assembled beside the second
    call."""
    n = x.shape[0]
    mine, theirs = _halves(rank_in(group), n)
    # allocated before the trade starts: the side stream, which writes it, waits for what the current stream queued
    # until then, so also for the last use of the memory the allocator hands out here
    gathered = x.new_empty(2 * n, *x.shape[1:])
    arriving = start_trade(x, group, GATHER)
    each_half(x, mine)

    def assemble(received):
        gathered[mine].copy_(x)
        gathered[theirs].copy_(received)
    arriving.on_side(assemble)
    each_half(arriving.wait(), theirs)
    arriving.join()
    return gathered


def _scatter(partial_of, n: int, group: str, rank: int) -> torch.Tensor:
    """The reduce-scatter of partial sums over both halves: ``partial_of(slice)`` makes one half's; the other's
    first, sent while this rank's own is made; returns this rank's half summed."""
    mine, theirs = _halves(rank, n)
    arriving = start_trade(partial_of(theirs), group, SCATTER)
    own = partial_of(mine)
    return own.add_(arriving.wait())


# ---- a column-parallel entry (QKV; fc1 of an MLP without the fused GELU)


@torch.library.custom_op("gptrain::sp_gather_linear", mutates_args=())
def sp_gather_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tuned: bool,
                     group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gathered @ w.T + b, gathered)``, ``gathered`` the tokens of both ranks (kept for the weight gradient)."""
    y = x.new_empty(2 * x.shape[0], w.shape[0])
    gathered = _gather_into(x, group, lambda rows, half: linear_fwd_into(rows, w, b, y[half], tuned))
    return y, gathered


@sp_gather_linear.register_fake
def _(x, w, b, tuned, group):
    return x.new_empty(2 * x.shape[0], w.shape[0]), x.new_empty(2 * x.shape[0], x.shape[1])


@torch.library.custom_op("gptrain::sp_gather_linear_backward", mutates_args=())
def sp_gather_linear_backward(g: torch.Tensor, gathered: torch.Tensor, w: torch.Tensor, tuned: bool,
                              group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's tokens' input gradient summed over both ranks, the weight gradient), the sum's trade beside
    this rank's own input gradient and the weight gradient."""
    n = g.shape[0] // 2
    mine, theirs = _halves(rank_in(group), n)
    _, dgrad, wgrad = linear_matmuls(tuned)
    arriving = start_trade(dgrad(g[theirs], w), group, SCATTER)
    grad_x = dgrad(g[mine], w)
    grad_w = wgrad(g, gathered)
    return grad_x.add_(arriving.wait()), grad_w


@sp_gather_linear_backward.register_fake
def _(g, gathered, w, tuned, group):
    return g.new_empty(g.shape[0] // 2, w.shape[1]), w.new_empty(w.shape)


# ---- a row-parallel exit (the attention projection; fc2 of an MLP without the fused GELU), before its bias


@torch.library.custom_op("gptrain::sp_linear_scatter", mutates_args=())
def sp_linear_scatter(h: torch.Tensor, w: torch.Tensor, tuned: bool, group: str) -> torch.Tensor:
    """``h @ w.T`` summed over both ranks, this rank's tokens only."""
    fwd = linear_matmuls(tuned)[0]
    return _scatter(lambda half: fwd(h[half], w, None), h.shape[0] // 2, group, rank_in(group))


@sp_linear_scatter.register_fake
def _(h, w, tuned, group):
    return h.new_empty(h.shape[0] // 2, w.shape[0])


@torch.library.custom_op("gptrain::sp_linear_scatter_backward", mutates_args=())
def sp_linear_scatter_backward(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, tuned: bool,
                               group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input gradient over both halves, the weight gradient) from this rank's tokens' output gradient ``g``,
    gathered half by half under the input gradient's matmuls."""
    grad_h = h.new_empty(h.shape)
    gathered = _gather_into(g, group, lambda rows, half: linear_dgrad_into(rows, w, grad_h[half], tuned))
    return grad_h, linear_matmuls(tuned)[2](gathered, h)


@sp_linear_scatter_backward.register_fake
def _(g, h, w, tuned, group):
    return h.new_empty(h.shape), w.new_empty(w.shape)


# ---- the fused bias-GELU MLP (kernels/ops.py): entry, fc1 with GELU, fc2, exit, before fc2's bias


@torch.library.custom_op("gptrain::sp_mlp", mutates_args=())
def sp_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
           group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fc2's output summed over both ranks for this rank's tokens, the gathered input, GELU's output and input
    over both halves: the last three kept for the backward)."""
    rows = 2 * x.shape[0]
    act, pre = x.new_empty(rows, w1.shape[0]), x.new_empty(rows, w1.shape[0])
    gathered = _gather_into(x, group, lambda h, half: linear_bias_gelu_into(h, w1, b1, act[half], pre[half]))
    out = _scatter(lambda half: linear_fwd(act[half], w2, None), x.shape[0], group, rank_in(group))
    return out, gathered, act, pre


@sp_mlp.register_fake
def _(x, w1, b1, w2, group):
    rows, width = 2 * x.shape[0], w1.shape[0]
    return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(rows, x.shape[1]), x.new_empty(rows, width), \
        x.new_empty(rows, width)


@torch.library.custom_op("gptrain::sp_mlp_backward", mutates_args=())
def sp_mlp_backward(g: torch.Tensor, gathered: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act: torch.Tensor,
                    pre: torch.Tensor, group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's tokens' input gradient, fc1's weight and bias gradients, fc2's weight gradient) from this
    rank's tokens' output gradient ``g``: gathered under the GELU-derivative matmuls, the input gradient's sum
    traded under this rank's own input gradient and the weight gradients."""
    grad_pre = torch.empty_like(pre)
    g_all = _gather_into(g, group, lambda rows, half: linear_dgelu_into(rows, w2, pre[half], grad_pre[half]))
    n = g.shape[0]
    mine, theirs = _halves(rank_in(group), n)
    arriving = start_trade(linear_dgrad(grad_pre[theirs], w1), group, SCATTER)
    grad_x = linear_dgrad(grad_pre[mine], w1)
    grad_w1, grad_w2 = linear_wgrad(grad_pre, gathered), linear_wgrad(g_all, act)
    grad_b1 = grad_pre.sum(0)
    return grad_x.add_(arriving.wait()), grad_w1, grad_b1, grad_w2


@sp_mlp_backward.register_fake
def _(g, gathered, w1, w2, act, pre, group):
    return g.new_empty(g.shape), w1.new_empty(w1.shape), w1.new_empty(w1.shape[0]), w2.new_empty(w2.shape)
