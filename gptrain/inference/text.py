"""Token ids -> text while streaming: byte-level BPE can split a character across tokens, so a
trailing incomplete character is held back until the next token completes it."""
from __future__ import annotations

import torch


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = 0  # characters already returned

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[self.emitted:], len(text)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens)
        delta, self.emitted = text[self.emitted:], len(text)
        return delta


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype: bf16 on a GPU by default (fp32 on the CPU)."""
    name = name or ("bf16" if device.type == "cuda" else "fp32")
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"--dtype {name}: use bf16, fp16 or fp32")
    return table[name]
