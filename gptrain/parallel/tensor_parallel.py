"""Tensor parallelism on plain tensors, as Megatron-LM does it: each rank holds its shard of a layer
as an ordinary parameter and the layer calls the collectives itself.

QKV and fc1 are column-parallel (rows split: each rank holds whole heads, the QKV rows being in
per-head order), the attention projection and fc2 row-parallel (columns split; their partial sums
are all-reduced before the bias), the word embeddings split by vocabulary rows (masked lookups,
all-reduced) and the loss vocabulary-parallel (max, sum of exponentials and the label's logit
all-reduced, never the logits). With ``--sequence-parallel`` the residual stream between the
regions holds 1/tp of the micro-batch's tokens on each rank: a region starts with an all-gather
and ends with a reduce-scatter instead of an all-reduce (the tokens are split as one flat run of
batch x sequence, so the collectives move contiguous memory).

The collectives are PyTorch's functional ones (``_c10d_functional``), which ``torch.compile`` keeps
inside one graph, and in the backward pass a column-parallel layer starts its input gradient's
reduction before it computes its weight gradient and waits for it after (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``). Parameter names stay those of one process;
``ShardLayout`` says which dimension of which parameter is split, for the initialisation, the
gradient norm, and checkpoints (where the shards become DTensors, so DCP reshards on load).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from gptrain.kernels.ops import linear_bias_gelu, linear_dgelu, linear_dgrad, linear_fwd, linear_matmuls, linear_wgrad
from gptrain.model.gpt import GPT
from gptrain.model.linear import FusedBiasGeluMLP, TunedLinear, linear_weight
from gptrain.parallel.copy_engine import all_reduce_beside_wgrads
from gptrain.parallel.sequence_parallel_ce import (sp_gather_linear, sp_gather_linear_backward, sp_linear_scatter,
                                                   sp_linear_scatter_backward, sp_mlp, sp_mlp_backward)

_c10d = torch.ops._c10d_functional

# ---- the collectives (asynchronous in eager mode until waited on; graph nodes when compiled)


def _all_reduce(t: torch.Tensor, group: str) -> torch.Tensor:
    return _c10d.all_reduce(t.contiguous(), "sum", group)


def _all_gather(t: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """The ranks' (n, ...) tensors stacked on dim 0 in rank order: (size x n, ...)."""
    return _c10d.all_gather_into_tensor(t.contiguous(), size, group)


def _reduce_scatter(t: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """Summed over the ranks, this rank's 1/size of dim 0."""
    return _c10d.reduce_scatter_tensor(t.contiguous(), "sum", size, group)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# ---- the mappings between the regions (Megatron's mappings.py), autograd's both ways


class _ExitRegion(torch.autograd.Function):
    """Partial sums -> whole (all-reduce; backward: identity), or with sequence parallelism ->
    this rank's tokens (reduce-scatter; backward: all-gather)."""

    @staticmethod
    def forward(ctx, y, group: str, size: int, sp: bool):
        ctx.group, ctx.size, ctx.sp, ctx.shape = group, size, sp, y.shape
        if not sp:
            return _wait(_all_reduce(y, group))
        return _wait(_reduce_scatter(_rows(y), size, group)).view(1, -1, y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        if not ctx.sp:
            return g, None, None, None
        return _wait(_all_gather(_rows(g), ctx.size, ctx.group)).view(ctx.shape), None, None, None


class _ScatterTokens(torch.autograd.Function):
    """Whole activations (the same on every rank) -> this rank's 1/size of the tokens; backward:
    all-gather."""

    @staticmethod
    def forward(ctx, x, group: str, size: int, rank: int):
        ctx.group, ctx.size, ctx.shape = group, size, x.shape
        tokens = _rows(x)
        n = tokens.shape[0] // size
        return tokens[rank * n:(rank + 1) * n].reshape(1, n, x.shape[-1])

    @staticmethod
    def backward(ctx, g):
        return _wait(_all_gather(_rows(g), ctx.size, ctx.group)).view(ctx.shape), None, None, None


class _GatherTokens(torch.autograd.Function):
    """This rank's tokens -> all of them, shaped (batch, seq, hidden); backward: this rank's part of
    the gradient (what follows, the vocabulary-parallel loss, gives every rank the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group: str, size: int, rank: int, seq: int):
        ctx.rank, ctx.size = rank, size
        return _wait(_all_gather(_rows(x), size, group)).view(-1, seq, x.shape[-1])

    @staticmethod
    def backward(ctx, g):
        tokens = _rows(g)
        n = tokens.shape[0] // ctx.size
        return tokens[ctx.rank * n:(ctx.rank + 1) * n].reshape(1, n, g.shape[-1]), None, None, None, None


def _enter(x2: torch.Tensor, group: str, size: int, sp: bool) -> torch.Tensor:
    return _wait(_all_gather(x2, size, group)) if sp else x2


def _start_input_grad_reduce(g2: torch.Tensor, group: str, size: int, sp: bool) -> torch.Tensor:
    return _reduce_scatter(g2, size, group) if sp else _all_reduce(g2, group)


def _beside_wgrads(t: torch.Tensor, grads: list[torch.Tensor], inputs: list[torch.Tensor], tuned: bool,
                   group: str) -> list[torch.Tensor]:
    """``--tp-comm-copy-engine``: [t summed over the two ranks, each weight gradient] (parallel/copy_engine.py)."""
    return all_reduce_beside_wgrads(t.contiguous(), grads, inputs, tuned, group)


def _out_shape(x: torch.Tensor, rows: int, width: int, sp: bool, seq: int) -> tuple[int, ...]:
    # with sequence parallelism the region's output covers every token of the micro-batch
    return (rows // seq, seq, width) if sp else (*x.shape[:-1], width)


class _ColumnParallel(torch.autograd.Function):
    """Enter a region (copy, or all-gather the tokens) and ``x @ w.T + b`` on this rank's rows. The
    backward starts the input gradient's all-reduce (reduce-scatter) before the weight gradient's
    matmul and waits for it after, so the two overlap."""

    @staticmethod
    def forward(ctx, x, w, b, group: str, size: int, sp: bool, seq: int, tuned: bool, copy_engine: bool):
        fwd, _, _ = linear_matmuls(tuned)
        x2 = _enter(_rows(x), group, size, sp)
        ctx.save_for_backward(x2, w)
        ctx.group, ctx.size, ctx.sp, ctx.tuned, ctx.x_shape = group, size, sp, tuned, x.shape
        ctx.has_bias, ctx.copy_engine = b is not None, copy_engine
        return fwd(x2, w, b).view(_out_shape(x, x2.shape[0], w.shape[0], sp, seq))

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        _, dgrad, wgrad = linear_matmuls(ctx.tuned)
        g2 = _rows(g)
        grad_b = g2.sum(0) if ctx.has_bias else None
        if ctx.copy_engine:  # the sum by the copy engines beside the weight gradient, one op
            summed, grad_w = _beside_wgrads(dgrad(g2, w), [g2], [x2], ctx.tuned, ctx.group)
            return summed.view(ctx.x_shape), grad_w, grad_b, None, None, None, None, None, None
        pending = _start_input_grad_reduce(dgrad(g2, w), ctx.group, ctx.size, ctx.sp)
        grad_w = wgrad(g2, x2)
        grad_x = _wait(pending).view(ctx.x_shape)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class _ColumnFusedMLP(torch.autograd.Function):
    """The fused bias-GELU MLP's two matmuls on this rank's shard (kernels/ops.py), entered like
    ``_ColumnParallel``: returns fc2's partial sums without its bias."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, group: str, size: int, sp: bool, seq: int, copy_engine: bool):
        x2 = _enter(_rows(x), group, size, sp)
        act, pre = linear_bias_gelu(x2, w1, b1)
        ctx.save_for_backward(x2, w1, w2, act, pre)
        ctx.group, ctx.size, ctx.sp, ctx.x_shape, ctx.copy_engine = group, size, sp, x.shape, copy_engine
        return linear_fwd(act, w2, None).view(_out_shape(x, x2.shape[0], w2.shape[0], sp, seq))

    @staticmethod
    def backward(ctx, g):
        x2, w1, w2, act, pre = ctx.saved_tensors
        g2 = _rows(g)
        grad_pre = linear_dgelu(g2, w2, pre)
        grad_b1 = grad_pre.sum(0)
        if ctx.copy_engine:  # the sum by the copy engines beside both weight gradients, one op
            summed, grad_w1, grad_w2 = _beside_wgrads(linear_dgrad(grad_pre, w1), [grad_pre, g2], [x2, act], True,
                                                      ctx.group)
            return summed.view(ctx.x_shape), grad_w1, grad_b1, grad_w2, None, None, None, None, None
        pending = _start_input_grad_reduce(linear_dgrad(grad_pre, w1), ctx.group, ctx.size, ctx.sp)
        grad_w1, grad_w2 = linear_wgrad(grad_pre, x2), linear_wgrad(g2, act)
        grad_x = _wait(pending).view(ctx.x_shape)
        return grad_x, grad_w1, grad_b1, grad_w2, None, None, None, None, None


# ---- --tp-comm-copy-engine with --sequence-parallel: the regions' gathers and scatters as copy-engine trades
# between the two ranks, half the tokens at a time under the matmuls (parallel/sequence_parallel_ce.py)


class _GatherColumnCE(torch.autograd.Function):
    """``_ColumnParallel``'s sequence-parallel entry and matmul as one op: this rank's tokens in, every token's
    ``x @ w.T + b`` on this rank's rows out."""

    @staticmethod
    def forward(ctx, x, w, b, group: str, seq: int, tuned: bool):
        y, gathered = sp_gather_linear(_rows(x).contiguous(), w, b, tuned, group)
        ctx.save_for_backward(gathered, w)
        ctx.group, ctx.tuned, ctx.x_shape, ctx.has_bias = group, tuned, x.shape, b is not None
        return y.view(-1, seq, w.shape[0])

    @staticmethod
    def backward(ctx, g):
        gathered, w = ctx.saved_tensors
        g2 = _rows(g).contiguous()
        grad_x, grad_w = sp_gather_linear_backward(g2, gathered, w, ctx.tuned, ctx.group)
        return grad_x.view(ctx.x_shape), grad_w, g2.sum(0) if ctx.has_bias else None, None, None, None


class _RowScatterCE(torch.autograd.Function):
    """A row-parallel matmul and the sequence-parallel exit as one op: every token's partial sums in, this rank's
    tokens summed out (before the bias)."""

    @staticmethod
    def forward(ctx, h, w, group: str, tuned: bool):
        h2 = _rows(h).contiguous()
        ctx.save_for_backward(h2, w)
        ctx.group, ctx.tuned, ctx.h_shape = group, tuned, h.shape
        return sp_linear_scatter(h2, w, tuned, group).view(1, -1, w.shape[0])

    @staticmethod
    def backward(ctx, g):
        h2, w = ctx.saved_tensors
        grad_h, grad_w = sp_linear_scatter_backward(_rows(g).contiguous(), h2, w, ctx.tuned, ctx.group)
        return grad_h.view(ctx.h_shape), grad_w, None, None


class _FusedMLPCE(torch.autograd.Function):
    """The fused bias-GELU MLP between the sequence-parallel entry and exit as one op (before fc2's bias)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, group: str):
        out, gathered, act, pre = sp_mlp(_rows(x).contiguous(), w1, b1, w2, group)
        ctx.save_for_backward(gathered, w1, w2, act, pre)
        ctx.group, ctx.x_shape = group, x.shape
        return out.view(x.shape[:-1] + (w2.shape[0],))

    @staticmethod
    def backward(ctx, g):
        gathered, w1, w2, act, pre = ctx.saved_tensors
        grad_x, grad_w1, grad_b1, grad_w2 = sp_mlp_backward(_rows(g).contiguous(), gathered, w1, w2, act, pre,
                                                            ctx.group)
        return grad_x.view(ctx.x_shape), grad_w1, grad_b1, grad_w2, None


@dataclass(frozen=True)
class TPGroup:
    """What a tensor-parallel layer needs to talk: the group's name (for the functional
    collectives), this rank, the size, and whether the residual stream is sequence-parallel."""
    name: str
    rank: int
    size: int
    sequence_parallel: bool
    seq_length: int
    comm_overlap: bool = False  # async TP: bare matmuls after the all-gathers (parallel/async_tp.py)
    # --tp-comm-copy-engine: input gradients summed by the copy engines (copy_engine.py); with sequence parallelism
    # the regions' gathers and scatters by them, under the matmuls (sequence_parallel_ce.py)
    copy_engine: bool = False

    @classmethod
    def of(cls, group, sequence_parallel: bool, seq_length: int, comm_overlap: bool = False,
           copy_engine: bool = False) -> "TPGroup":
        return cls(group.group_name, dist.get_rank(group), dist.get_world_size(group), sequence_parallel, seq_length,
                   comm_overlap, copy_engine)


def _shard(t: torch.Tensor, dim: int, tp: TPGroup) -> nn.Parameter:
    """This rank's part of ``t`` along ``dim`` (on the meta device: only the shape matters)."""
    return nn.Parameter(t.detach().chunk(tp.size, dim=dim)[tp.rank].clone(), requires_grad=t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` split by output rows; ``tuned``: on the cuBLASLt ops."""

    def __init__(self, linear: nn.Linear, tp: TPGroup):
        super().__init__()
        self.tp, self.tuned = tp, isinstance(linear, TunedLinear)
        self.weight = _shard(linear.weight, 0, tp)
        self.bias = None if linear.bias is None else _shard(linear.bias, 0, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp.copy_engine and tp.sequence_parallel:
            return _GatherColumnCE.apply(x, self.weight, self.bias, tp.name, tp.seq_length, self.tuned)
        if tp.comm_overlap and self.bias is not None:  # the bias after the matmul, which async TP can fuse
            return _ColumnParallel.apply(x, self.weight, None, tp.name, tp.size, tp.sequence_parallel,
                                         tp.seq_length, self.tuned, False) + self.bias
        return _ColumnParallel.apply(x, self.weight, self.bias, tp.name, tp.size, tp.sequence_parallel,
                                     tp.seq_length, self.tuned, tp.copy_engine)


class RowParallelLinear(nn.Module):
    """``nn.Linear`` split by input columns: this rank's partial sums, reduced, then the bias (whole
    on every rank)."""

    def __init__(self, linear: nn.Linear, tp: TPGroup):
        super().__init__()
        self.tp, self.tuned = tp, isinstance(linear, TunedLinear)
        self.weight = _shard(linear.weight, 1, tp)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp.copy_engine and tp.sequence_parallel:
            y = _RowScatterCE.apply(x, self.weight, tp.name, self.tuned)
            return y if self.bias is None else y + self.bias
        y = linear_weight(x, self.weight, self.tuned)
        y = _ExitRegion.apply(y, tp.name, tp.size, tp.sequence_parallel)
        return y if self.bias is None else y + self.bias


class TensorParallelFusedMLP(nn.Module):
    """``FusedBiasGeluMLP`` on this rank's shards of fc1 (rows) and fc2 (columns)."""

    def __init__(self, mlp: FusedBiasGeluMLP, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.fc1 = nn.Module()
        self.fc1.weight, self.fc1.bias = _shard(mlp.fc1.weight, 0, tp), _shard(mlp.fc1.bias, 0, tp)
        self.fc2 = nn.Module()
        self.fc2.weight, self.fc2.bias = _shard(mlp.fc2.weight, 1, tp), mlp.fc2.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp.copy_engine and tp.sequence_parallel:
            return _FusedMLPCE.apply(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, tp.name) + self.fc2.bias
        y = _ColumnFusedMLP.apply(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, tp.name, tp.size,
                                  tp.sequence_parallel, tp.seq_length, tp.copy_engine)
        return _ExitRegion.apply(y, tp.name, tp.size, tp.sequence_parallel) + self.fc2.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [rank x V/tp, (rank + 1) x V/tp) of the (padded) vocabulary: ids elsewhere
    look up zeros, and the sum over the ranks is every id's row."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = _shard(embedding.weight, 0, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return _ExitRegion.apply(out, self.tp.name, self.tp.size, False)


class ScatterTokens(nn.Module):
    """Sequence parallelism's entry: the embeddings (whole on every rank) -> this rank's tokens."""

    def __init__(self, tp: TPGroup):
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScatterTokens.apply(x, self.tp.name, self.tp.size, self.tp.rank)


class GatherTokens(nn.Module):
    """Sequence parallelism's exit, after the final LayerNorm: every token again, for the loss."""

    def __init__(self, tp: TPGroup):
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        return _GatherTokens.apply(x, tp.name, tp.size, tp.rank, tp.seq_length)


# ---- the vocabulary-parallel loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross-entropy of ``h @ w.T`` where each rank holds the rows
    [rank x V/tp, (rank + 1) x V/tp) of w: max, sum of exponentials and the label's logit are
    all-reduced, never the logits. Returns each token's loss. Columns from ``vocab_size`` on
    (padding) get no probability. Only the logits in their own dtype are kept for the backward,
    which recomputes the softmax: every pass over them is a reduction or an elementwise map that
    the compiler fuses into one kernel."""

    @staticmethod
    def forward(ctx, h, w_local, labels, vocab_size: int, group: str, rank: int, tuned: bool):
        fwd, _, _ = linear_matmuls(tuned)
        width = w_local.shape[0]
        first = rank * width
        logits = fwd(h, w_local, None)
        index = (labels - first).clamp(0, width - 1)
        local = (labels >= first) & (labels < first + width)
        masked = _masked(logits, first, vocab_size)
        row_max = _wait(_c10d.all_reduce(masked.max(dim=-1).values, "max", group))
        sum_exp = torch.exp(masked - row_max[:, None]).sum(dim=-1)
        target = torch.where(local, masked.gather(1, index[:, None]).squeeze(1), torch.zeros_like(row_max))
        sums = _wait(_all_reduce(torch.stack([sum_exp, target]), group))  # the two sums in one all-reduce
        losses = torch.log(sums[0]) + row_max - sums[1]
        ctx.save_for_backward(h, w_local, logits, row_max, sums[0], index, local)
        ctx.group, ctx.tuned, ctx.first, ctx.vocab_size = group, tuned, first, vocab_size
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        h, w_local, logits, row_max, sum_exp, index, local = ctx.saved_tensors
        _, dgrad, wgrad = linear_matmuls(ctx.tuned)
        probs = torch.exp(_masked(logits, ctx.first, ctx.vocab_size) - row_max[:, None]) / sum_exp[:, None]
        # minus the one-hot of each label this rank holds, elementwise (no scatter, no data-dependent shape)
        column = torch.arange(logits.shape[1], device=logits.device)
        onehot = ((column[None, :] == index[:, None]) & local[:, None]).to(probs.dtype)
        grad = ((probs - onehot) * grad_losses[:, None]).to(h.dtype)
        pending = _all_reduce(dgrad(grad, w_local), ctx.group)  # h feeds every rank's share of the vocabulary
        grad_w = wgrad(grad, h)
        return _wait(pending), grad_w, None, None, None, None, None


def _masked(logits: torch.Tensor, first: int, vocab_size: int) -> torch.Tensor:
    """The logits in fp32 with the padding columns at -inf."""
    column = torch.arange(first, first + logits.shape[1], device=logits.device)
    return logits.float().masked_fill(column >= vocab_size, float("-inf"))


class VocabParallelLMLoss(nn.Module):
    """The language-model loss with the output layer's weight split by vocabulary rows (the mean
    token loss, or Megatron's masked mean with ``--eod-mask-loss``)."""

    def __init__(self, vocab_size: int, tp: TPGroup, tuned: bool = False):
        super().__init__()
        self.vocab_size, self.tp, self.tuned = vocab_size, tp, tuned

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        losses = _VocabParallelCrossEntropy.apply(_rows(h), weight, labels.reshape(-1), self.vocab_size,
                                                  self.tp.name, self.tp.rank, self.tuned)
        if loss_mask is None:
            return losses.mean()
        mask = loss_mask.reshape(-1).to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


# ---- which parameter is split where


@dataclass
class ShardLayout:
    """Per parameter name, the dimension split over the tensor-parallel ranks (absent: whole on
    every rank), and the parameters whose gradients are partial per rank under sequence
    parallelism (LayerNorms and row-parallel biases see only this rank's tokens: Megatron
    all-reduces them over the tensor-parallel group). Empty without tensor parallelism."""
    tp: TPGroup | None = None
    mesh: DeviceMesh | None = None  # the whole (pp, dp, tp) mesh
    split_dim: dict[str, int] = field(default_factory=dict)
    sequence_parallel_grads: list[str] = field(default_factory=list)
    _tp_dp: DeviceMesh | None = None

    def region(self, name: str, full_shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """This rank's part of the full tensor ``name`` (the tensor-parallel split only; None: all)."""
        dim = self.split_dim.get(name)
        if dim is None:
            return None
        region = [slice(0, n) for n in full_shape]
        n = full_shape[dim] // self.tp.size
        region[dim] = slice(self.tp.rank * n, (self.tp.rank + 1) * n)
        return tuple(region)

    def is_split(self, name: str) -> bool:
        return name in self.split_dim

    def full_shape(self, name: str, local_shape) -> tuple[int, ...]:
        """The whole tensor's shape of ``name`` given this rank's (tensor-parallel) part of it."""
        shape = list(local_shape)
        if (dim := self.split_dim.get(name)) is not None:
            shape[dim] *= self.tp.size
        return tuple(shape)

    def checkpoint_view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (this rank's shard of parameter ``name``, or of its optimizer state) as a DTensor of
        the full tensor sharing ``t``'s memory, so DCP writes and reads it in place at its offsets;
        whole tensors and FSDP2 shards of whole tensors as they are."""
        from torch.distributed.tensor import DTensor, Shard

        dim = self.split_dim.get(name)
        if dim is None or t.dim() == 0:  # whole, or AdamW's step count
            return t
        if isinstance(t, DTensor):  # an FSDP2 shard (over dp) of this rank's tensor-parallel shard
            mesh, placements, local = self._tp_dp_mesh(), (Shard(dim), *t.placements), t.to_local()
        else:
            mesh, placements, local = self.mesh["tp"], (Shard(dim),), t
        shape = self.full_shape(name, t.shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    def _tp_dp_mesh(self) -> DeviceMesh:
        # tensor-parallel split first, then FSDP2's over dp inside it: a (tp, dp) mesh (every rank
        # builds it, at the first checkpoint, as all ranks save together)
        if self._tp_dp is None:
            ranks = self.mesh.mesh.permute(0, 2, 1).contiguous()
            whole = DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=("pp", "tp", "dp"))
            self._tp_dp = whole["tp", "dp"]
        return self._tp_dp

    @torch.no_grad()
    def reduce_sequence_parallel_grads(self, params: dict[str, torch.Tensor]) -> None:
        """Sum over the tensor-parallel ranks the gradients that each rank took on its own tokens."""
        from gptrain.parallel.shards import local

        grads = [local(params[n].grad) for n in self.sequence_parallel_grads
                 if n in params and params[n].grad is not None]
        if not grads:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.mesh["tp"].get_group())
        torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))


_SPLIT = {"attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.proj.weight": 1,
          "mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1,
          "mlp.gate.weight": 0, "mlp.gate.bias": 0, "mlp.up.weight": 0, "mlp.up.bias": 0}


def split_dim_of(name: str) -> int | None:
    """Megatron's split of a gptrain parameter name (None: whole on every tensor-parallel rank)."""
    if name in ("word_embeddings.weight", "output_layer.weight"):  # the latter: an untied output layer
        return 0
    for suffix, dim in _SPLIT.items():
        if name.endswith("." + suffix):
            return dim
    return None


def apply_tensor_parallel(model: GPT, mesh: DeviceMesh, sequence_parallel: bool = False,
                          comm_overlap: bool = False, copy_engine: bool = False) -> ShardLayout:
    """Megatron's split of ``model`` (on the meta device, after the kernel converter) over the
    mesh's ``tp`` dimension: the blocks' linear layers, the word embeddings and, with
    ``sequence_parallel``, the token split of the residual stream. Returns which parameter is
    split where. ``comm_overlap``: the column-parallel layers in the form async TP rewrites;
    ``copy_engine``: their input gradients summed by the copy engines beside the weight gradients."""
    tp = TPGroup.of(mesh["tp"].get_group(), sequence_parallel, model.cfg.seq_length, comm_overlap, copy_engine)
    # Megatron's dropout: the same masks on every tensor-parallel rank outside the parallel regions
    # (hashed, per position in the micro-batch), a per-rank stream inside them (train/run.py)
    model.hashed_dropout = True
    shard = (tp.rank, tp.size) if sequence_parallel else (0, 1)
    for block in model.layers.values():
        block.attn.qkv = ColumnParallelLinear(block.attn.qkv, tp)
        block.attn.proj = RowParallelLinear(block.attn.proj, tp)
        if isinstance(block.mlp, FusedBiasGeluMLP):
            block.mlp = TensorParallelFusedMLP(block.mlp, tp)
        else:
            for name in ("fc1", "gate", "up"):  # the GELU MLP's fc1, SwiGLU's gate and up
                if hasattr(block.mlp, name):
                    setattr(block.mlp, name, ColumnParallelLinear(getattr(block.mlp, name), tp))
            block.mlp.fc2 = RowParallelLinear(block.mlp.fc2, tp)
        block.dropout_shard = shard
    if model.word_embeddings is not None:
        model.word_embeddings = VocabParallelEmbedding(model.word_embeddings, tp)
        if model.output_layer is not None and not model.cfg.untie_embeddings_and_output_weights:
            model.output_layer.weight = model.word_embeddings.weight  # the tie survives the swap
    if model.output_layer is not None and model.cfg.untie_embeddings_and_output_weights:
        model.output_layer.weight = _shard(model.output_layer.weight, 0, tp)  # vocabulary rows, as the embeddings
    if sequence_parallel:
        model.scatter_tokens, model.gather_tokens = ScatterTokens(tp), GatherTokens(tp)
    layout = ShardLayout(tp, mesh)
    for name, _ in model.named_parameters():
        if (dim := split_dim_of(name)) is not None:
            layout.split_dim[name] = dim
        elif sequence_parallel and name != "position_embeddings.weight":
            layout.sequence_parallel_grads.append(name)
    return layout
