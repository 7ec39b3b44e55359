"""What gptrain's decode loops agree on about a step: the batch and attention buckets its graphs are
captured for, the ``Mode`` of a step (what it does besides the forward), and which models the fused
GPU step runs (``plain_model``: GPT-2's own layers; the others decode through graph_step.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gptrain.model.gpt import GPT

MIN_LENGTH = 64  # the shortest attention bucket


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (batch buckets)."""
    return 1 << max(0, (n - 1).bit_length())


def length_bucket(n: int, window: int) -> int:
    """How many cache positions a step that needs ``n`` of them attends over."""
    return min(window, max(MIN_LENGTH, bucket(n)))


@dataclass(frozen=True)
class Mode:
    """What a step's graph does besides the forward (one graph per mode and bucket)."""
    greedy: bool = True  # every row greedy: argmax only, no sort or noise
    logprobs: bool = False  # the chosen token's log-probability
    top_n: int = 0  # the n most likely tokens and their log-probabilities
    colon: tuple[int, int] | None = None  # (colon id, eol id): no eol right after a colon, per row
    decay: bool = False  # Megatron's top_p decay

    @classmethod
    def of(cls, params, colon: tuple[int, int] | None = None, logprobs: bool = False, top_n: int = 0) -> "Mode":
        """The mode a batch of rows with these ``SamplingParams`` needs (every decode loop's rule)."""
        return cls(greedy=all(p.temperature <= 0 or p.top_k == 1 for p in params), logprobs=logprobs, top_n=top_n,
                   colon=colon, decay=any(p.top_p_decay > 0 for p in params))


def _gpt2_blocks(model: GPT, row_linear: type) -> bool:
    """GPT-2's blocks (LayerNorms with weights, the MLP) whose QKV and fc1 are ``nn.Linear`` and whose
    attention projection and fc2 are ``row_linear``: what the fused decode kernels run."""
    from gptrain.model.gpt import MLP

    norms = [model.final_layernorm] + [m for blk in model.layers.values() for m in (blk.ln1, blk.ln2)]
    return (model.cfg.gpt2_layout  # the decode kernels are GPT-2's; other layers take the generic KV-cache path
            and all(type(m) is torch.nn.LayerNorm and m.weight is not None for m in norms)
            and all(type(blk.mlp) is MLP and type(blk.attn.qkv) is torch.nn.Linear and type(blk.mlp.fc1) is torch.nn.Linear
                    and type(blk.attn.proj) is row_linear and type(blk.mlp.fc2) is row_linear
                    for blk in model.layers.values()))


def plain_model(model: GPT) -> bool:
    """Whether the blocks are the model's own modules (no kernel swap, no tensor parallelism)."""
    return _gpt2_blocks(model, torch.nn.Linear)


def tensor_parallel_group(model: GPT):
    """The process group a model split by ``inference/tensor_parallel.localize`` runs over, or None."""
    proj = model.layers["0"].attn.proj if len(model.layers) else None
    return getattr(proj, "group", None) if type(proj).__name__ == "RowParallelLinear" else None


def fused_decodable(model: GPT) -> bool:
    """Whether rows.py's fused decode step runs ``model``: GPT-2's blocks on the model's own modules
    (``plain_model``), or split over tensor-parallel ranks by ``localize`` (its row-parallel layers
    all-reduce inside the step)."""
    if plain_model(model):
        return True
    if tensor_parallel_group(model) is None:
        return False
    from gptrain.inference.tensor_parallel import GatheredOutputLayer, RowParallelLinear, VocabParallelEmbedding

    return (type(model.word_embeddings) is VocabParallelEmbedding and type(model.output_layer) is GatheredOutputLayer
            and model.position_embeddings is not None and _gpt2_blocks(model, RowParallelLinear))
