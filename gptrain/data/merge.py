"""``gptrain merge-datasets``: concatenate indexed datasets (Megatron's tools/merge_datasets.py)."""
from __future__ import annotations

import os
from pathlib import Path

from gptrain.data.indexed import IndexedDataset, IndexedDatasetWriter, data_file, index_file
from gptrain.data.provenance import provenance_record, read_provenance


def find_prefixes(inputs: list[str], output_prefix: str | None = None) -> list[str]:
    """Dataset prefixes from directories (every ``*.idx`` inside, sorted, but the output's own:
    merging into a folder that is also an input must not count its previous output) and explicit
    prefixes (the output itself refused)."""
    out = os.path.abspath(output_prefix) if output_prefix else None
    prefixes: list[str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(str(p)[: -len(".idx")] for p in path.glob("*.idx"))
            found = [p for p in found if os.path.abspath(p) != out]
            if not found:
                raise FileNotFoundError(f"--input {item}: the directory holds no .idx file"
                                        + (" but the output's own" if out and Path(out).parent == path.resolve() else ""))
            prefixes.extend(found)
        else:
            prefix = item[:-4] if item.endswith((".idx", ".bin")) else item
            if not index_file(prefix).is_file():
                raise FileNotFoundError(f"--input {item}: no {index_file(prefix)}")
            if os.path.abspath(prefix) == out:
                raise ValueError(f"--input {item} is the --output-prefix itself: merge into a new prefix")
            prefixes.append(prefix)
    return prefixes


def merge_datasets(inputs: list[str], output_prefix: str, overwrite: bool = False) -> IndexedDataset:
    prefixes = find_prefixes(inputs, output_prefix)
    for path in (data_file(output_prefix), index_file(output_prefix)):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} already exists: pass --overwrite to replace it")
    datasets = [IndexedDataset(p) for p in prefixes]
    tokenizers = {str((read_provenance(p) or {}).get("tokenizer", {}).get("sha256")) for p in prefixes}
    if len(tokenizers) > 1:
        raise ValueError(f"the inputs were made with {len(tokenizers)} different tokenizers; merge only like data")
    first = read_provenance(prefixes[0])
    sidecar = None
    if first is not None:
        sidecar = provenance_record(first["tokenizer"], inputs=[data_file(p) for p in prefixes], counts={
            "documents": sum(d.num_documents for d in datasets), "tokens": sum(d.num_tokens for d in datasets),
        }, extra={"merged_from": prefixes})
    writer = IndexedDatasetWriter(output_prefix, datasets[0].dtype)
    try:
        for ds in datasets:
            writer.add_index(ds)
        writer.finalize(sidecar)  # without a sidecar, an old one at the output prefix is removed
    except BaseException:
        writer.abort()
        raise
    return IndexedDataset(output_prefix)
