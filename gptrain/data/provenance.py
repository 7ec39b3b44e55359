"""Provenance sidecar ``{prefix}.json`` beside each ``.bin/.idx`` pair (the index has no room for it):
which tokenizer made the tokens, from which inputs, with what counts. Training refuses data whose
sidecar names another tokenizer."""
from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from gptrain import __version__

FORMAT = "gptrain-provenance/1"


def provenance_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.json")


def write_provenance(prefix: str, tokenizer_info: dict, inputs: list[Path], counts: dict, extra: dict | None = None) -> None:
    record = {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gptrain_version": __version__,
        "tokenizer": tokenizer_info,
        "inputs": [{"path": str(p), "bytes": p.stat().st_size} for p in inputs],
        "counts": counts,
        **(extra or {}),
    }
    path = provenance_file(prefix)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def read_provenance(prefix: str | os.PathLike) -> dict | None:
    path = provenance_file(prefix)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def check_tokenizer(prefix: str | os.PathLike, tokenizer) -> str | None:
    """Raise if ``prefix`` was made with another tokenizer; return a warning if that is unknown."""
    record = read_provenance(prefix)
    if record is None:
        return f"{prefix}: no provenance sidecar (made by another tool?); its tokenizer cannot be checked"
    made_with = record.get("tokenizer", {})
    if made_with.get("sha256") != tokenizer.fingerprint:
        raise ValueError(
            f"{prefix} was tokenized with another vocabulary/merges (sha256 {str(made_with.get('sha256'))[:12]}..., "
            f"vocab size {made_with.get('vocab_size')}) than this run's ({tokenizer.fingerprint[:12]}..., "
            f"vocab size {tokenizer.vocab_size}): preprocess it again with this run's --vocab-file/--merge-file"
        )
    return None
