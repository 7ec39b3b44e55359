"""Provenance sidecar ``{prefix}.json`` beside each ``.bin/.idx`` pair (the index has no room for it):
which tokenizer made the tokens, from which inputs, with what counts, and which ``.idx`` and ``.bin``
it describes (the ``.idx``'s size and sha256, the ``.bin``'s size and ``indexed.bin_fingerprint``).
The three files are one unit: a sidecar whose ``.idx`` record does not match the ``.idx`` beside it is
stale and never trusted, and a ``.bin`` other than the one written with the ``.idx`` is refused, each
in one line at train time. Training refuses data whose sidecar names another tokenizer. Data made by
other tools (Megatron's, no sidecar) is not checked."""
from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from gptrain import __version__
from gptrain.data.indexed import bin_fingerprint, data_file, index_file, index_sha256, sidecar_file

FORMAT = "gptrain-provenance/2"


class StaleProvenance(ValueError):
    """The sidecar describes other data than the ``.bin/.idx`` beside it."""


def provenance_file(prefix: str | os.PathLike) -> Path:
    return sidecar_file(prefix)


def provenance_record(tokenizer_info: dict, inputs: list[Path], counts: dict, extra: dict | None = None) -> dict:
    """The sidecar's content; ``IndexedDatasetWriter.finalize`` adds the ``index`` entry and publishes it."""
    return {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gptrain_version": __version__,
        "tokenizer": tokenizer_info,
        "inputs": [{"path": str(p), "bytes": p.stat().st_size} for p in inputs],
        "counts": counts,
        **(extra or {}),
    }


def _check_describes(prefix, record: dict) -> None:
    path = provenance_file(prefix)
    idx = index_file(prefix)
    if not idx.is_file():
        return
    index = record.get("index")
    if isinstance(index, dict):  # format 2: the .idx's size and hash
        if idx.stat().st_size != index.get("idx_bytes") or index_sha256(prefix) != index.get("idx_sha256"):
            raise StaleProvenance(f"{path} is stale: it describes another {idx.name} than the one beside it "
                                  f"(an interrupted or partial write?); preprocess {prefix} again, or delete {path}")
        _check_bin(prefix, path, idx, index)
        return
    # format 1 recorded only counts: check those
    from gptrain.data.indexed import IndexedDataset

    counts = record.get("counts", {})
    ds = IndexedDataset(prefix)
    if (counts.get("documents"), counts.get("tokens")) != (ds.num_documents, ds.num_tokens):
        raise StaleProvenance(f"{path} is stale: it counts {counts.get('documents')} documents / {counts.get('tokens')} "
                              f"tokens, {idx.name} holds {ds.num_documents} / {ds.num_tokens}; preprocess {prefix} "
                              f"again, or delete {path}")


def _check_bin(prefix, sidecar: Path, idx: Path, index: dict) -> None:
    """The ``.bin`` beside the ``.idx`` is the one written with it: its size and ``bin_fingerprint`` as
    the sidecar records them (sidecars written before the fingerprint are not checked)."""
    recorded = index.get("bin_sample_sha256")
    bin_path = data_file(prefix)
    if recorded is None or not bin_path.is_file():
        return
    size = bin_path.stat().st_size
    found = bin_fingerprint(bin_path)
    if size != index.get("bin_bytes") or found != recorded:
        raise StaleProvenance(f"{bin_path} does not belong with {idx}: {sidecar} records a {bin_path.name} of "
                              f"{index.get('bin_bytes')} bytes (sampled sha256 {str(recorded)[:12]}...), this one has "
                              f"{size} bytes ({found[:12]}...): a .bin from another run? put back the .bin written "
                              f"with {idx.name}, or preprocess {prefix} again")


def read_provenance(prefix: str | os.PathLike, verify: bool = True) -> dict | None:
    """The sidecar, or None; raises ``StaleProvenance`` if it does not describe the ``.idx`` beside it."""
    path = provenance_file(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise StaleProvenance(f"{path} is not a readable provenance sidecar (truncated?); preprocess {prefix} "
                              f"again, or delete {path}") from None
    if not isinstance(record, dict):
        raise StaleProvenance(f"{path} is not a provenance sidecar")
    if verify:
        _check_describes(prefix, record)
    return record


def check_tokenizer(prefix: str | os.PathLike, tokenizer) -> str | None:
    """Raise if ``prefix`` was made with another tokenizer (or its sidecar is stale); return a warning
    if that is unknown."""
    record = read_provenance(prefix)
    if record is None:
        return f"{prefix}: no provenance sidecar (made by another tool?); its tokenizer cannot be checked"
    made_with = record.get("tokenizer", {})
    if made_with.get("sha256") != tokenizer.fingerprint:
        raise ValueError(
            f"{prefix} was tokenized with another vocabulary/merges (sha256 {str(made_with.get('sha256'))[:12]}..., "
            f"vocab size {made_with.get('vocab_size')}) than this run's ({tokenizer.fingerprint[:12]}..., "
            f"vocab size {tokenizer.vocab_size}): preprocess it again with this run's tokenizer flags (--vocab-file/--merge-file, --tokenizer-model)"
        )
    return None
