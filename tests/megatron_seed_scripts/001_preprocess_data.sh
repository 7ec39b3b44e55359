python tools/preprocess_data.py \
--input /workspace/data/oscar-1GB.jsonl \
--output-prefix /workspace/data/my-gpt2 \
--vocab-file /workspace/model/gpt2-vocab/gpt2-vocab.json \
--dataset-impl mmap \
--tokenizer-type GPT2BPETokenizer \
--merge-file /workspace/model/gpt2-vocab/gpt2-merges.txt \
--append-eod \
--workers 20 \
--chunk-size 25
