"""The CUDA-graph decode step for layers the fused decode kernels do not cover (Llama-style blocks:
RMSNorm, RoPE, K/V groups, SwiGLU; any model ``steps.plain_model`` refuses) and for tensor parallelism,
where the step's all-reduces and the logits' all-gather are captured with it (every rank captures and
replays the same graphs at the same steps, rank 0's ids kept in step by ``generate``'s ``sync``).

``generate``'s one-token forward is ``kv_cache.forward_cached``: its shapes change every step (the
cache slice grows), so it runs eagerly, kernel by kernel, with the host in the way. ``GraphStep`` runs
the same blocks (the model's own modules) with the position in a device tensor: the key and value go
into the cache at that position, attention reads the first ``L`` cached positions under a mask of
``0 .. t`` (one graph per power-of-two ``L``: steps.py's buckets), so one captured graph replays for
every step of its bucket. ``generate`` keeps its host loop, stop rules and sampling; only its
``step_fn`` is this. Elsewhere than CUDA the same step runs eagerly (the tests' path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gptrain.inference.steps import length_bucket
from gptrain.inference.generate import generate
from gptrain.inference.host_loop import capture, model_cache
from gptrain.inference.kv_cache import KVCache, logits_of
from gptrain.model.gpt import GPT

KEPT = 4  # GraphSteps (each with a whole-window cache) kept per model, by batch size


class GraphStep:
    def __init__(self, model: GPT, batch: int, use_graph: bool = True):
        self.model, self.batch = model, batch
        self.window = model.cfg.max_position_embeddings
        self.cache = KVCache(model, batch, self.window)
        device = self.cache.kv.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.use_graph = use_graph and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graph else None

    @torch.no_grad()
    def forward(self, length: int) -> torch.Tensor:
        """fp32 logits (batch, vocab) of ``self.tokens`` at ``self.position``, attending over the
        first ``length`` cache positions."""
        model, cache, pos = self.model, self.cache, self.position
        x = model.word_embeddings(self.tokens)
        if model.position_embeddings is not None:
            x = x + model.position_embeddings(pos)
        visible = (torch.arange(length, device=pos.device) <= pos)[None, None, None, :]
        for i, block in enumerate(model.layers.values()):
            query, key, value = block.attn.heads(block.attn.qkv(block.ln1(x)), pos)
            cache.k[i].index_copy_(2, pos, key)
            cache.v[i].index_copy_(2, pos, value)
            y = F.scaled_dot_product_attention(query, cache.k[i, :, :, :length], cache.v[i, :, :, :length],
                                               attn_mask=visible, enable_gqa=key.shape[1] != query.shape[1])
            x = x + block.attn.proj(y.transpose(1, 2).reshape(self.batch, 1, -1))
            x = x + block.mlp(block.ln2(x))
        return logits_of(model, model.final_layernorm(x)[:, -1])

    def __call__(self, chosen: torch.Tensor, t: int) -> torch.Tensor:
        """``generate``'s step_fn: the logits after feeding ``chosen`` (batch, 1) at position ``t``."""
        self.tokens.copy_(chosen)
        self.position.fill_(t)
        length = length_bucket(t + 1, self.window)
        if not self.use_graph:
            return self.forward(length)
        if length not in self.graphs:
            # the warm-ups write this step's key and value at t, as the replay then does again
            out: list[torch.Tensor] = []
            graph = capture(lambda: out.append(self.forward(length)), lambda: out.clear(), pool=self.pool)
            self.graphs[length] = (graph, out[-1])
        graph, logits = self.graphs[length]
        graph.replay()
        return logits


def step_for(model: GPT, batch: int, use_graph: bool = True) -> GraphStep:
    steps = model_cache(model, "_graph_steps")
    key = (batch, use_graph)
    if key not in steps:
        while len(steps) >= KEPT:
            steps.pop(next(iter(steps)))
        steps[key] = GraphStep(model, batch, use_graph)
    return steps[key]


def graph_step_generate(model: GPT, prompts: list[list[int]], params, use_graph: bool = True, **kw):
    """``generate`` (same arguments but ``cache`` and ``step_fn``) with the graph step (``use_graph``
    False: the same static-shape step, eagerly)."""
    if not prompts:
        return []
    step = step_for(model, len(prompts), use_graph)
    return generate(model, prompts, params, cache=step.cache, step_fn=step, **kw)
