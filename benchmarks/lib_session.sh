# Shared steps of the single-GPU session scripts (sourced; `part` set by the caller):
#   session_setup        wheels from .whl/ into /tmp/site, logs in /tmp/logs, pack -> $OUT/<part>.tgz,
#                        device.txt (GPU, driver, torch, transformers, triton)
#   serve_345m_load      a 2-iteration 345M bf16 checkpoint, `gptrain serve` on it, serve_load.py with
#                        32 clients for 30 s then 1 client for 15 s, the server stopped; logs ck345,
#                        serve, load32, load1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
FINAL=${OUT:-/tmp/out}; L=/tmp/logs
pack() { tar czf "$FINAL/$part.tgz" -C $L .; }

session_setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
  mkdir -p "$FINAL" $L
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } > $L/device.txt 2>&1
  cat $L/device.txt
}

serve_345m_load() {
  local M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
  timeout 120 python3 -m gptrain train $M345 --mock-data --micro-batch-size 4 --global-batch-size 4 --train-iters 2 \
    --lr 1e-4 --bf16 --eval-iters 2 --save /tmp/ck345 --save-interval 2 > $L/ck345.txt 2>&1; echo "train rc $?" >> $L/ck345.txt
  python3 -m gptrain serve --load /tmp/ck345 --port 5055 > $L/serve.txt 2>&1 &
  local server=$!
  for i in $(seq 90); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:5055/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  timeout 100 python3 benchmarks/serve_load.py --url http://127.0.0.1:5055 --clients 32 --seconds 30 --tokens 64 > $L/load32.txt 2>&1
  echo "load rc $?" >> $L/load32.txt
  timeout 60 python3 benchmarks/serve_load.py --url http://127.0.0.1:5055 --clients 1 --seconds 15 --tokens 64 > $L/load1.txt 2>&1
  echo "load rc $?" >> $L/load1.txt
  kill $server 2>/dev/null; pack
  tail -3 $L/ck345.txt; cat $L/load32.txt $L/load1.txt; tail -5 $L/serve.txt
}
