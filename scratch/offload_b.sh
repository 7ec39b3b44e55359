#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site DS_ACCELERATOR=cuda
nvidia-smi -L; date
ONLY="${ROWS}" bash benchmarks/run.sh offload 2>&1 | tail -8
date
timeout ${ADAMW_S:-100} python3 benchmarks/host_adamw.py --params 1e9 --threads 8 16 > $OUT/host_adamw.txt 2>&1; tail -25 $OUT/host_adamw.txt
date
