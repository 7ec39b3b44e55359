"""gptrain's folder in the user's cache directory (``$XDG_CACHE_HOME/gptrain``, else
``~/.cache/gptrain``): what may be recomputed at any time (calibration tables, checksums of files
already verified, a tokenizer's BPE tables), never anything a run needs to resume."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptrain"


def keep(path: Path, data: bytes) -> None:
    """``data`` as the whole of the cache file ``path``: written beside it and renamed over it, so a
    reader (another process, another rank) sees the old file or the new one, never half of one. A
    cache that cannot be written (a read-only home) is left as it is: nothing a run needs is lost."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:  # the cache stays as it was; a half-written copy beside it goes
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
