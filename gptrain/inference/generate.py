"""Greedy decoding, enough for the demo's sample (the inference issue adds KV cache and sampling)."""
from __future__ import annotations

import torch

from gptrain.model.gpt import GPT


@torch.no_grad()
def greedy(model: GPT, prompt: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
    model.eval()
    device = next(model.parameters()).device
    tokens = list(prompt)
    window = model.cfg.max_position_embeddings
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-window:]], device=device)
        next_id = int(model.logits(context)[0, -1].argmax())
        if next_id == stop_id:
            break
        tokens.append(next_id)
    return tokens[len(prompt):]
