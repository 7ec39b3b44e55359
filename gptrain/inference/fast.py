"""The GPU decode step as a CUDA graph over a static cache.

One graph per batch bucket (1, 2, 4, ... rows; a batch is padded with score-only rows to its
bucket) replays the whole one-token forward: the new key and value go to the cache at the position
held in a device tensor, and attention reads the full static cache under a mask of the positions
written so far, so the shapes never change and nothing is read back to the host. The prefill and
everything else is ``generate``'s own code, given this step and this cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gptrain.inference.generate import SamplingParams, generate
from gptrain.inference.kv_cache import KVCache
from gptrain.model.gpt import GPT


class GraphDecoder:
    def __init__(self, model: GPT, batch: int, use_graph: bool = True):
        self.model = model
        self.window = model.cfg.max_position_embeddings
        self.cache = KVCache(model, batch, self.window)
        device = self.cache.k.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.keys = torch.arange(self.window, device=device)
        self.graph = None
        self.logits = None
        if use_graph and device.type == "cuda":
            self._capture()

    @torch.no_grad()
    def _step(self) -> torch.Tensor:
        model, cache = self.model, self.cache
        b = self.tokens.shape[0]
        pos = self.position.view(1)
        x = model.word_embeddings(self.tokens) + model.position_embeddings(pos)
        mask = (self.keys <= self.position)[None, None, None, :]
        for i, block in enumerate(model.layers.values()):
            qkv = block.attn.qkv(block.ln1(x))
            qkv = qkv.view(b, 1, qkv.shape[-1] // (3 * model.cfg.head_dim), 3, model.cfg.head_dim)
            query, key, value = qkv.permute(3, 0, 2, 1, 4)
            cache.k[i].index_copy_(2, pos, key)
            cache.v[i].index_copy_(2, pos, value)
            y = F.scaled_dot_product_attention(query, cache.k[i], cache.v[i], attn_mask=mask)
            x = x + block.attn.proj(y.transpose(1, 2).reshape(b, 1, -1))
            x = x + block.mlp(block.ln2(x))
        return model.output_layer(model.final_layernorm(x))[:, -1].float()

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the graph (cuBLAS workspaces, lazy inits)
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()
        self.cache.k.zero_()
        self.cache.v.zero_()

    def __call__(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Logits (batch, vocab) after feeding ``tokens`` (batch, 1) at ``position``."""
        self.tokens.copy_(tokens, non_blocking=True)
        self.position.fill_(position)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits


_decoders: dict[tuple[int, int], GraphDecoder] = {}


def bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def graph_generate(model: GPT, prompts: list[list[int]], params, **kw):
    """``generate`` with the CUDA-graph decode step (same arguments and results)."""
    if not prompts:
        return []
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if kw.get("step_fn") is not None or kw.get("cache") is not None:
        raise ValueError("graph_generate supplies its own step_fn and cache")
    n = len(prompts)
    size = bucket(n)
    key = (id(model), size)
    if key not in _decoders:
        _decoders[key] = GraphDecoder(model, size)
    decoder = _decoders[key]
    pad = size - n
    prompts = list(prompts) + [prompts[0][:1]] * pad  # one-token score-only rows
    params = list(params) + [SamplingParams(max_new_tokens=0)] * pad
    colon = kw.pop("no_newline_after_colon", None)
    if colon:
        colon = list(colon) + [False] * pad
    hook = kw.pop("on_token", None)
    out = generate(model, prompts, params, cache=decoder.cache, step_fn=decoder,
                   on_token=None if hook is None else (lambda row, tok: hook(row, tok) if row < n else True),
                   no_newline_after_colon=colon, **kw)
    return out[:n]
