"""gptrain's folder in the user's cache directory (``$XDG_CACHE_HOME/gptrain``, else
``~/.cache/gptrain``): what may be recomputed at any time (calibration tables, checksums of files
already verified, a tokenizer's BPE tables), never anything a run needs to resume."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptrain"
