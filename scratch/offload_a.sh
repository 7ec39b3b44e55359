#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site DS_ACCELERATOR=cuda
nvidia-smi -L; nproc; free -g | head -2
date
timeout 120 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_offload_split.py > $OUT/lane_offload.txt 2>&1; tail -3 $OUT/lane_offload.txt
date
ONLY="${ROWS}" bash benchmarks/run.sh offload 2>&1 | tail -30
date
