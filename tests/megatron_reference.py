"""Megatron-LM's own code paths, used as references: megatron-core's IndexedDatasetBuilder and
IndexedDataset, and the per-line logic of tools/preprocess_data.py (core_r0.8.0) re-stated here
with an independent tokenizer (Hugging Face tokenizers)."""
from __future__ import annotations

import json
import warnings

import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset  # noqa: F401
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def megatron_preprocess(jsonl_path, output_prefix, hf_tokenizer, key="text", append_eod=True, eod=50256):
    """What tools/preprocess_data.py writes for a clean JSONL file (GPT2BPETokenizer, no splitting)."""
    builder = IndexedDatasetBuilder(f"{output_prefix}.bin", dtype=np.uint16)
    with open(jsonl_path, encoding="utf-8") as fin:
        for line in fin:
            text = json.loads(line)[key]
            doc_ids, sentence_lens = [], []
            for sentence in [text]:
                ids = hf_tokenizer.encode(sentence).ids
                if len(ids) > 0:
                    doc_ids.extend(ids)
                    sentence_lens.append(len(ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(eod)
                sentence_lens[-1] += 1
            builder.add_document(doc_ids, sentence_lens)
    builder.finalize(f"{output_prefix}.idx")
