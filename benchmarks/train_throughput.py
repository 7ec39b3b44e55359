"""Training throughput of gptrain's real step against the in-process baseline: ``gptrain bench``.

    python benchmarks/train_throughput.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 1024 --micro-batch-size 16 --bf16 --compile --warmup 6 --iters 15
"""
import sys

from gptrain.bench import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
