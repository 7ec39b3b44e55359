"""Megatron-LM's own Llama 3 8B example (examples/llama/train_llama3_8b_h100_fp8.sh, its bf16 branch with mock data)
runs under gptrain with every one of its flags, the model shrunk (layers, widths, vocabulary, sequence) and the
samples cut so that it trains on two CPU processes (TP2 + SP, as the script sets them); --profile with torch's
profiler, since nsys's capture needs a GPU. The flags below are the script's, in its order."""
from __future__ import annotations

import math

import pytest

from distributed import losses, torchrun

MODEL = ("--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 "
         "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 64 --max-position-embeddings 64 "
         "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
         "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
         "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear")
TRAINING = ("--micro-batch-size 1 --global-batch-size 4 --train-samples 32 --lr-decay-samples 28 "
            "--lr-warmup-samples 8 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
            "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
            "--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
            "--empty-unused-memory-level 1 --exit-duration-in-mins 235 "
            "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
PARALLEL = "--tensor-model-parallel-size 2 --context-parallel-size 1 --sequence-parallel"
DATA = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path {cache} --tiktoken-pattern v2 "
        "--split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1")
LOGGING = ("--log-interval 1 --eval-iters 2 --eval-interval 4 --save-interval 1000 --log-throughput --profile "
           "--use-pytorch-profiler --profile-step-start 2 --profile-step-end 4 --ckpt-format torch_dist "
           "--distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}")


@pytest.mark.slow
def test_the_llama3_8b_example_trains_with_all_its_flags(tmp_path):
    flags = " ".join([MODEL, TRAINING, PARALLEL, DATA, LOGGING]).format(
        cache=tmp_path / "cache", ckpt=tmp_path / "ckpt", tb=tmp_path / "tb").split() + ["--device", "cpu"]
    out = torchrun(2, flags, timeout=600)
    got = losses(out)
    assert sorted(got) == list(range(1, 9)) and all(math.isfinite(v) for v in got.values())
    assert "tensor-model-parallel size: 2" in out
    assert "garbage collection: Python's collector off while training (--manual-gc)" in out
    assert (tmp_path / "torch_profile" / "rank-0.json.gz").exists() and (tmp_path / "torch_profile" / "rank-1.json.gz").exists()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
