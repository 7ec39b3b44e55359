"""The first thing a restarted run says: which restart this is, the iteration it resumed from and how
many iterations it lost since its last checkpoint.

A launcher that restarts the group (``torchrun --max-restarts N``, a SLURM requeue) starts the same
command again; with ``--load`` and ``--save`` on one folder gptrain resumes from the newest checkpoint
there. To count what was lost, rank 0 keeps the last iteration it logged in a one-line file beside
the checkpoints (replaced atomically at each log interval, ignored by everything that reads
checkpoints).
"""
from __future__ import annotations

import os
from pathlib import Path

from gptrain.parallel.dims import is_logging_rank
from gptrain.train.signals import deferred_signals

PROGRESS_FILE = ".gptrain_last_logged_iteration"


def restart_count() -> int:
    """How many times the launcher has restarted this job: torchrun's ``TORCHELASTIC_RESTART_COUNT``,
    SLURM's ``SLURM_RESTART_COUNT`` (a requeue); 0 for a first start."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def record(save: str | None, iteration: int) -> None:
    """Rank 0 notes the last iteration it logged (best effort: a full disk must not stop training)."""
    if not save or not is_logging_rank():
        return
    path = Path(save) / PROGRESS_FILE
    tmp = path.with_name(f"{PROGRESS_FILE}.{os.getpid()}.tmp")
    with deferred_signals():  # a SIGINT/SIGTERM here takes effect after the file is replaced or removed
        try:
            tmp.write_text(f"{iteration}\n")
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)


def last_logged(save: str | None) -> int | None:
    if not save:
        return None
    try:
        text = (Path(save) / PROGRESS_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def resume_line(save: str | None, resumed_from: int | None, load_seconds: float | None) -> str | None:
    """The line for a restarted job (``None`` for a first start that finds no earlier progress)."""
    restarts = restart_count()
    before = last_logged(save)
    if not restarts and before is None:
        return None
    where = "from scratch (no checkpoint)" if not resumed_from else f"from iteration {resumed_from}"
    took = "" if load_seconds is None else f", loaded in {load_seconds:.1f} s"
    lost = "unknown" if before is None else str(max(0, before - (resumed_from or 0)))
    who = f"restart {restarts} of this job" if restarts else "a run logged here before"
    return f" > {who}: resumed {where}{took}; iterations lost since the last checkpoint: {lost} " \
           f"(last logged: {before if before is not None else 'none recorded'})"
