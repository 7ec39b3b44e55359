"""Megatron-LM's flags of today's Llama scripts that gptrain takes: --empty-unused-memory-level releases the CUDA
allocator's unused blocks after each step's forward and backward passes and each evaluation batch (1), and after
the optimizer step too (2), as Megatron-LM's training loop does; --calculate-per-token-loss is the mean gptrain
takes where every micro-batch counts the same tokens, refused with --eod-mask-loss; --context-parallel-size 1,
--no-create-attention-mask-in-dataloader, --no-mmap-bin-files and --cross-entropy-loss-fusion are accepted with
what gptrain does instead, and a context-parallel size above 1 is refused in one line."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY
from gptrain.config import parse_megatron_args
from gptrain.train.run import train_main

RUN = TINY + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"]


def _releases(monkeypatch, level: int) -> int:
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    assert train_main(RUN + ["--empty-unused-memory-level", str(level)], log=lambda s: None).exit_code == 0
    return len(calls)


def test_the_allocator_is_emptied_at_megatrons_points(monkeypatch):
    assert _releases(monkeypatch, 0) == 0
    level1, level2 = _releases(monkeypatch, 1), _releases(monkeypatch, 2)
    evaluations = 2 + 2  # at iterations 2 and 4, then the end's validation and test, one batch each
    assert level1 == 4 + evaluations  # each step's forward and backward passes, each evaluation batch
    assert level2 == level1 + 4  # and each optimizer step


def test_todays_llama_script_flags_are_accepted_with_their_reason():
    cfg, notes = parse_megatron_args(RUN + ["--context-parallel-size", "1", "--no-create-attention-mask-in-dataloader",
                                            "--no-mmap-bin-files", "--cross-entropy-loss-fusion"], world_size=1)
    said = " | ".join(notes)
    for flag in ("--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--cross-entropy-loss-fusion"):
        assert f"{flag}: accepted, " in said
    with pytest.raises(ValueError, match="--context-parallel-size 2: only 1 is supported; context parallelism"):
        parse_megatron_args(RUN + ["--context-parallel-size", "2"], world_size=1)


def test_per_token_loss_trains_the_same_mean_and_is_refused_with_an_eod_mask():
    plain = train_main(RUN, log=lambda s: None)
    per_token = train_main(RUN + ["--calculate-per-token-loss"], log=lambda s: None)
    assert per_token.exit_code == 0 and per_token.train_losses == plain.train_losses  # every micro-batch: 64 tokens
    with pytest.raises(ValueError, match="--calculate-per-token-loss with --eod-mask-loss is not built yet"):
        parse_megatron_args(RUN + ["--calculate-per-token-loss", "--eod-mask-loss"], world_size=1)
