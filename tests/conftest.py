"""Shared fixtures: one tokenizer per session, small corpora built on the fly (no downloads)."""
from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile

import pytest

from gptrain.tokenizer import GPT2Tokenizer, default_vocab_files

# the user's cache folder (checksums, calibration tables) of this test session only, for every process it starts
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="gptrain-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

WORDS = ("the of and to in is was for on that with as by at from his her an were which this be are "
         "model data token train loss GPU 2024 3.14 naïve café 東京 😀 — \"quoted\" it's we'll").split()


@pytest.fixture(scope="session")
def tokenizer() -> GPT2Tokenizer:
    return GPT2Tokenizer()


@pytest.fixture(scope="session")
def hf_reference_tokenizer():
    """An independent GPT-2 BPE (Hugging Face tokenizers) built from the same vocab and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = default_vocab_files()
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def random_text(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        parts.append(rng.choice(WORDS))
        parts.append(rng.choice([" ", " ", " ", "  ", "\n", "\n\n", ", ", ". "]))
    return "".join(parts)


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture
def corpus(tmp_path):
    """A 300-document JSONL file with a few documents spanning many lengths."""
    rng = random.Random(0)
    texts = [random_text(rng, rng.choice([0, 1, 5, 30, 200, 800])) for _ in range(300)]
    return write_jsonl(tmp_path / "corpus.jsonl", texts), texts


@pytest.fixture
def no_tf32():
    """fp32 products in fp32 (no TF32) for one test, restored after it."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
