"""``--tp-overlap-halves``: tensor-parallel blocks run on two halves of the micro-batch, so that each half's
all-reduce (the attention's and the MLP's exits) runs while the other half computes (DeepSpeed's Domino).
Without it the forward's all-reduces have nothing beside them: the next layer needs their sum.

The order, half a and half b through every block:

    a: attention, its sum started  | b: (the last block's MLP sum waited on) attention, its sum started
    a: sum waited on, MLP, started | b: sum waited on, MLP, started
    a: MLP's sum waited on, and the next block's attention ...

so every started sum has the other half's next matmuls queued between it and its wait. The backward is autograd's
(each column-parallel layer's input-gradient all-reduce already runs beside its weight gradients). The halves'
hidden dropout draws the masks of the whole micro-batch's rows, so the run trains as without the split.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from gptrain.parallel.tensor_parallel import TensorParallelFusedMLP


def _attention_started(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block.attn.proj.start(block.attn.mix(block.ln1(x)))


def _mlp_started(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    mlp = block.mlp
    if isinstance(mlp, TensorParallelFusedMLP):
        return mlp.start(block.ln2(x))
    return mlp.fc2.start(mlp.hidden(block.ln2(x)))


def _mlp_finished(block: nn.Module, started: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    mlp = block.mlp
    return mlp.finish(started, after) if isinstance(mlp, TensorParallelFusedMLP) else mlp.fc2.finish(started, after)


class OverlappedHalves(nn.Module):
    """Runs ``blocks`` (GPT's ``Block``s, tensor-parallel, without sequence parallelism) on the two halves of
    ``x``'s batch dimension, interleaved as the module's docstring says. Holds no state."""

    def forward(self, x: torch.Tensor, blocks: list[nn.Module], step: torch.Tensor | None) -> torch.Tensor:
        if not blocks:
            return x
        a, b = x.chunk(2, dim=0)
        rows_b = a.shape[0]  # b's first row in the micro-batch, for its dropout masks
        pending_b = None  # (block, b's MLP sum started): waited on once a's next attention is queued
        # each wait names the other half's sum started after it as its ``after``: the other half's matmuls before
        # that sum stay between this sum's start and its wait
        for block in blocks:
            started_a = _attention_started(block, a)
            if pending_b is not None:
                b = b + pending_b[0].dropout(_mlp_finished(*pending_b, started_a), step, 1, rows_b)
            started_b = _attention_started(block, b)
            a = a + block.dropout(block.attn.proj.finish(started_a, started_b), step, 0)
            mlp_a = _mlp_started(block, a)
            b = b + block.dropout(block.attn.proj.finish(started_b, mlp_a), step, 0, rows_b)
            pending_b = (block, _mlp_started(block, b))
            a = a + block.dropout(_mlp_finished(block, mlp_a, pending_b[1]), step, 1)
        b = b + pending_b[0].dropout(_mlp_finished(*pending_b, a), step, 1, rows_b)
        return torch.cat((a, b), dim=0)
