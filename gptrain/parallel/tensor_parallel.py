"""Tensor parallelism on DTensor: Megatron's column/row split of each block, the vocabulary-parallel
word embeddings, and a vocabulary-parallel cross-entropy that never gathers the logits.

QKV and fc1 are column-parallel (each rank holds whole heads: the QKV rows are in per-head order),
the attention projection and fc2 row-parallel (their outputs all-reduced), the word embeddings split
by vocabulary rows. Between the blocks' parallel regions activations are whole, plain tensors on
every rank, so LayerNorms, dropout and the model's own code stay as they are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from gptrain.model.gpt import GPT


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Megatron's split; with ``sequence_parallel`` the residual stream between the parallel regions,
    its LayerNorms and dropout hold 1/tp of the sequence on each rank (the row-parallel outputs are
    reduce-scattered instead of all-reduced, and gathered again before each column-parallel input)."""
    if sequence_parallel:
        plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    # Megatron's dropout: the same masks on every tensor-parallel rank outside the parallel regions
    # (hashed, per position of the whole sequence), a per-rank stream inside them (train/run.py)
    model.hashed_dropout = True
    shard = (tp_mesh.get_local_rank(), tp_mesh.size()) if sequence_parallel else (0, 1)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
        block.dropout_shard = shard
    if sequence_parallel and model.pre_process:
        # the embeddings' sum (whole on every rank) enters the first block as this rank's sequence share
        # (pipeline stages after the first receive the shares as they are)
        # (the block's second input, the dropout step, passes as it is)
        parallelize_module(model.layers["0"], tp_mesh, PrepareModuleInput(input_layouts=(Replicate(), None),
                                                                         desired_input_layouts=(Shard(1), None),
                                                                         use_local_output=True))
    if sequence_parallel and model.post_process:
        # the final LayerNorm runs on the shares and the loss gets the whole sequence back
        parallelize_module(model.final_layernorm, tp_mesh, SequenceParallel())
        parallelize_module(model.final_layernorm, tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
    if model.word_embeddings is not None:
        # vocabulary-parallel embedding: each rank looks up its rows, the partial sums are all-reduced
        # (on the last pipeline rank it is the output layer's copy, split the same way)
        parallelize_module(model.word_embeddings, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if model.output_layer is not None:
        model.output_layer.weight = model.word_embeddings.weight  # the tie survives the swap to a DTensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross-entropy of ``h @ w.T`` where each rank holds the rows
    [rank x V/tp, (rank + 1) x V/tp) of w: max, sum of exponentials and the label's logit are
    all-reduced, never the logits. Returns each token's loss. Columns from ``vocab_size`` on
    (padding) get no probability."""

    @staticmethod
    def forward(ctx, h, w_local, labels, vocab_size: int, group):
        rank = dist.get_rank(group)
        width = w_local.shape[0]
        first = rank * width
        logits = (h @ w_local.t()).float()
        column = torch.arange(first, first + width, device=h.device)
        logits = logits.masked_fill(column >= vocab_size, float("-inf"))
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(logits - row_max[:, None])
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local = (labels >= first) & (labels < first + width)
        index = (labels - first).clamp(0, width - 1)
        target = torch.where(local, logits.gather(1, index[:, None]).squeeze(1), torch.zeros_like(row_max))
        dist.all_reduce(target, group=group)
        losses = torch.log(sum_exp) + row_max - target
        probs = exp / sum_exp[:, None]
        ctx.save_for_backward(h, w_local, probs, index, local)
        ctx.group = group
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        h, w_local, probs, index, local = ctx.saved_tensors
        # minus the one-hot of each label this rank holds, as a scatter: boolean indexing's data-dependent
        # shape (nonzero) breaks the compiled graph and makes the host wait for the GPU
        grad = probs.scatter_add_(1, index[:, None], -local.to(probs.dtype)[:, None])
        grad = (grad * grad_losses[:, None]).to(h.dtype)
        grad_h = grad @ w_local
        dist.all_reduce(grad_h, group=ctx.group)  # h feeds every rank's share of the vocabulary
        return grad_h, grad.t() @ h, None, None, None


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: DTensor, labels: torch.Tensor, vocab_size: int,
                                 loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean token cross-entropy with the output layer's weight split by vocabulary rows."""
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    group = weight.device_mesh.get_group()
    losses = _VocabParallelCrossEntropy.apply(h2, weight.to_local(), y, vocab_size, group)
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.reshape(-1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
