"""Tensor-parallel inference, as Megatron serves: each rank of one host holds 1/tp of every layer.

The model is built and loaded with the training stack (``apply_tensor_parallel`` on a meta GPT, the
checkpoint read into its shards), then ``localize`` swaps the training layers for forward-only ones
over the same shards with Megatron's explicit collectives: QKV and fc1 keep their rows (whole
heads, no communication), the attention projection and fc2 all-reduce their partial sums before
the bias, the vocabulary-parallel embedding all-reduces its masked lookups, and the output layer
all-gathers the vocabulary shards of the logits. Decoding then runs the model's own code, and the KV
cache holds this rank's heads only.

``StepSync`` keeps the ranks in step while generating: after each token rank 0 broadcasts the ids
it chose and whether it goes on (a stream that ended a row, a stop string, only rank 0 knows).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gptrain.model.gpt import GPT


class RowParallelLinear(nn.Module):
    """``x_local @ W_local.T`` summed over the ranks, then the (whole) bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [first, first + rows) of the (padded) vocabulary; ids elsewhere look up
    zeros, and the sum over the ranks is every id's row."""

    def __init__(self, weight: torch.Tensor, first: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first = first
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredOutputLayer(nn.Module):
    """Logits over the real vocabulary: each rank's shard of the columns, all-gathered (rank order is
    vocabulary order), the padding cut off."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group):
        super().__init__()
        self.weight = weight  # the embedding's local rows (tied), or the untied output layer's
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _column(linear: nn.Linear) -> nn.Linear:
    w, b = _local(linear.weight), _local(linear.bias)
    out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        out.bias = nn.Parameter(b, requires_grad=False)
    return out


def localize(model: GPT, group) -> GPT:
    """Swap the training layers ``apply_tensor_parallel`` made for forward-only ones over the same
    shards (in place; returns the model). Forward-only: the collectives here have no backward."""
    for block in model.layers.values():
        block.attn.qkv = _column(block.attn.qkv)  # whole heads, or whole K/V groups with their queries
        for name in ("fc1", "gate", "up"):  # GPT-2's MLP, or SwiGLU's two input layers
            if hasattr(block.mlp, name):
                setattr(block.mlp, name, _column(getattr(block.mlp, name)))
        block.attn.proj = RowParallelLinear(_local(block.attn.proj.weight), _local(block.attn.proj.bias), group)
        block.mlp.fc2 = RowParallelLinear(_local(block.mlp.fc2.weight), _local(block.mlp.fc2.bias), group)
    weight = _local(model.word_embeddings.weight)
    first = dist.get_rank(group) * weight.shape[0]
    model.word_embeddings = VocabParallelEmbedding(weight, first, group)
    head = _local(model.output_layer.weight) if model.cfg.untie_embeddings_and_output_weights \
        else model.word_embeddings.weight
    model.output_layer = GatheredOutputLayer(head, model.cfg.vocab_size, group)
    return model


class StepSync:
    """``generate``'s per-step hook: one broadcast from rank 0 of (batch + 1) int64 on the model's
    device, the chosen ids and the go-on flag. The other ranks feed rank 0's ids, so a row's text
    never depends on the ranks' logits agreeing to the last bit."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0)

    def __call__(self, chosen: torch.Tensor, go_on: bool) -> tuple[torch.Tensor, bool]:
        message = torch.cat([chosen, chosen.new_tensor([int(go_on)])])
        dist.broadcast(message, src=self.src, group=self.group)
        if self.rank == 0:
            return chosen, go_on
        return message[:-1], bool(message[-1].item())
