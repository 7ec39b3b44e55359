"""``gptrain data inspect PREFIX``: what an indexed dataset holds, and the text of a document."""
from __future__ import annotations

import numpy as np

from gptrain.data.indexed import IndexedDataset
from gptrain.data.provenance import StaleProvenance, read_provenance


def describe(prefix: str, document: int | None = None, tokenizer=None, max_chars: int = 2000) -> str:
    ds = IndexedDataset(prefix)
    lengths = ds.document_lengths()
    lines = [
        f"dataset:    {prefix}",
        f"documents:  {ds.num_documents}",
        f"sequences:  {len(ds.sizes)}",
        f"tokens:     {ds.num_tokens}",
        f"dtype:      {ds.dtype}",
    ]
    if len(lengths):
        q = np.percentile(lengths, [0, 10, 50, 90, 99, 100]).astype(int)
        lines.append(f"doc length: mean {lengths.mean():.1f}, min {q[0]}, p10 {q[1]}, median {q[2]}, "
                     f"p90 {q[3]}, p99 {q[4]}, max {q[5]}")
        edges = [0, 16, 64, 256, 1024, 4096, 16384, np.inf]
        hist, _ = np.histogram(lengths, bins=edges)
        for lo, hi, n in zip(edges[:-1], edges[1:], hist):
            bar = "#" * int(round(40 * n / max(1, hist.max())))
            label = f"[{int(lo)}, {'inf' if hi == np.inf else int(hi)})"
            lines.append(f"  {label:>14} {n:>9} {bar}")
    try:
        record = read_provenance(prefix)
    except StaleProvenance as err:
        record = None
        lines.append(f"tokenizer:  unknown ({err})")
    if record:
        tok = record.get("tokenizer", {})
        lines.append(f"tokenizer:  {tok.get('type')} vocab {tok.get('vocab_size')} eod {tok.get('eod')} "
                     f"sha256 {str(tok.get('sha256'))[:16]}...")
    if document is not None:
        tokens = ds.get(document)
        text = tokenizer.decode(tokens.tolist()) if tokenizer is not None else " ".join(map(str, tokens[:200]))
        shown = text if len(text) <= max_chars else text[:max_chars] + f"... [{len(text) - max_chars} more characters]"
        lines.append(f"--- document {document} ({len(tokens)} tokens) ---")
        lines.append(shown)
    return "\n".join(lines)
