"""Checkpoints never lose work: a save killed (SIGKILL) at each point of its protocol, a tracker
naming a missing or truncated folder, a write that fails (the file-size limit standing in for a
full disk), and SIGTERM/SIGINT with and without --exit-signal-handler, each followed by a resume."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from distributed import TINY, _env, free_port, losses
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.checkpoint_kind import TRACKER
from gptrain.train.checkpoint import load_checkpoint
from gptrain.file_hash import file_sha256
from gptrain.train.checkpoint_files import is_complete, read_tracker
from gptrain.train.run import train_main
from gptrain.train.restart_note import PROGRESS_FILE
from gptrain.train.save_lock import LOCK_NAME

SCHEDULE = ["--lr-decay-iters", "6"]  # one schedule for runs of 4 and 6 iterations
RUN = TINY + SCHEDULE + ["--save-interval", "2"]


def _train(argv: list[str]) -> tuple[int, list[str]]:
    lines: list[str] = []
    return train_main(argv, log=lines.append).exit_code, lines


def _subprocess(argv: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptrain", "train", *argv], capture_output=True, text=True,
                          timeout=300, env={**_env(), **(env or {})}, **kw)


def _dot_entries(root) -> list[str]:
    """Temporary and moved-aside folders (the run's lock file is neither)."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.name not in (LOCK_NAME, PROGRESS_FILE))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Six iterations without a break, and a checkpoint folder of the first four (iterations 2, 4)."""
    root = tmp_path_factory.mktemp("ck")
    rc, lines = _train(RUN + ["--train-iters", "6"])
    assert rc == 0
    rc, _ = _train(RUN + ["--train-iters", "4", "--save", str(root / "ck")])
    assert rc == 0 and read_tracker(root / "ck") == 4
    return losses("\n".join(lines)), root / "ck"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["written", "moved-aside", "tracker"])
def test_killed_while_resaving_an_iteration_then_resume(point, straight, tmp_path):
    """A run rolled back to iteration 2 (its tracker edited, as after a loss spike) re-saves
    iteration 4 over the live copy; SIGKILL at each step of that save; the next start restores or
    keeps a complete iteration 4, resumes from the tracker's iteration and matches the straight run."""
    ref, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    (ck / TRACKER).write_text("2")
    done = _subprocess(TINY + SCHEDULE + ["--train-iters", "4", "--save-interval", "4", "--load", str(ck),
                                          "--save", str(ck)], env={"GPTRAIN_CRASH_AT": f"{point}@4"})
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-2000:]
    assert _dot_entries(ck), "the kill should leave a temporary or moved-aside folder behind"
    rc, lines = _train(RUN + ["--train-iters", "6", "--load", str(ck), "--save", str(ck)])
    assert rc == 0
    start = 4 if point == "tracker" else 2
    assert "  successfully loaded checkpoint from %s at iteration %d" % (ck, start) in lines
    if point in ("written", "moved-aside"):
        assert any(line.startswith("WARNING: re") for line in lines), lines[:30]
    got = losses("\n".join(lines))
    assert sorted(got) == list(range(start + 1, 7)) and all(got[i] == ref[i] for i in got), (got, ref)
    assert _dot_entries(ck) == [] and read_tracker(ck) == 6
    assert all(is_complete(ck / f"iter_{i:07d}")[0] for i in (2, 4, 6))


def _model():
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"], world_size=1)
    return cfg, GPT(cfg.model)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_tracker_on_a_missing_or_truncated_folder_falls_back_loudly(damage, straight, tmp_path):
    _, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    if damage == "missing":
        shutil.rmtree(ck / "iter_0000004")
    else:
        data = ck / "iter_0000004" / "__0_0.distcp"
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    cfg, model = _model()
    warned: list[str] = []
    state = load_checkpoint(ck, dict(model.named_parameters()), None, cfg.model.vocab_size, log=warned.append)
    assert state["iteration"] == 2
    assert len(warned) == 1 and warned[0].startswith(f"WARNING: {ck / TRACKER} names iter_0000004, which is")
    assert "loading the newest complete checkpoint, iter_0000002, instead" in warned[0]
    shutil.rmtree(ck / "iter_0000002")
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        load_checkpoint(ck, dict(model.named_parameters()), None, cfg.model.vocab_size, log=warned.append)


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))  # each checkpoint's data file is ~20 MB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead


@pytest.mark.slow
def test_a_failing_disk_is_one_line_and_leaves_nothing_half_written(straight, tmp_path):
    _, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    before = sorted(p.name for p in ck.iterdir())
    done = _subprocess(RUN + ["--train-iters", "6", "--load", str(ck), "--save", str(ck)],
                       preexec_fn=_limit_file_size)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [f"gptrain: error: could not save the checkpoint of iteration 6 to {ck}: File too large; its partial files were removed and the newest "
                      f"complete checkpoint is {ck}/iter_0000004"], done.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == before and read_tracker(ck) == 4
    rc, lines = _train(RUN + ["--train-iters", "6", "--load", str(ck), "--save", str(ck)])  # room again
    assert rc == 0 and read_tracker(ck) == 6 and not any(line.startswith("WARNING") for line in lines)


def _start(argv: list[str], nproc: int = 0) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "gptrain", "train"] if nproc else [sys.executable, "-m", "gptrain", "train"]
    return subprocess.Popen(launcher + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())


def _wait_for_iteration(proc: subprocess.Popen, n: int) -> list[str]:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f" iteration {n:8d}/"):
            return seen
    raise AssertionError("the run ended early:\n" + "".join(seen)[-3000:] + proc.stderr.read()[-3000:])


LONG = TINY + ["--train-iters", "100000"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_without_the_handler_a_signal_is_one_line_naming_the_last_checkpoint(sig, tmp_path):
    proc = _start(LONG + ["--save", str(tmp_path / "ck"), "--save-interval", "2"])
    _wait_for_iteration(proc, 3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig
    newest = read_tracker(tmp_path / "ck")
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and re.fullmatch(
        rf"gptrain: stopped by {sig.name} at iteration \d+; the newest complete checkpoint is "
        rf"{re.escape(str(tmp_path / 'ck'))}/iter_{newest:07d}", lines[0]), err[-3000:]
    assert _dot_entries(tmp_path / "ck") == []


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.slow
def test_exit_signal_on_one_rank_stops_every_rank_at_the_same_iteration(tmp_path):
    proc = _start(LONG + ["--save", str(tmp_path / "ck"), "--exit-signal-handler"], nproc=2)
    _wait_for_iteration(proc, 3)
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGTERM)  # one rank only: the other learns it through the all-reduce
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    it = read_tracker(tmp_path / "ck")
    assert f"exiting program after receiving SIGTERM at iteration {it}; saved" in out
    cfg, model = _model()
    state = load_checkpoint(tmp_path / "ck", dict(model.named_parameters()), None, cfg.model.vocab_size)
    assert state["iteration"] == it and state["layout"]["dp"] == 2
    assert torch.isfinite(model.get_parameter("layers.0.attn.qkv.weight")).all()


class _RunsCode:
    """Unpickling this calls ``os.system``: what a crafted ``.metadata`` would do to DCP's plain pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _restamp(folder):
    """Rewrite the manifest's sizes, as a crafted folder would, so that it counts as complete."""
    import json

    state = json.loads((folder / "state.json").read_text())
    state["files"] = {name: (folder / name).stat().st_size for name in state["files"]}
    state["checksums"] = {name: file_sha256(folder / name) for name in state["checksums"]}  # a crafter can too
    (folder / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("craft", ["code", "bytes-entry", "outside-path"])
def test_a_crafted_dcp_metadata_is_refused_without_running_code(craft, straight, tmp_path):
    """DCP's own reader unpickles ``.metadata`` with code allowed and loads byte entries with
    ``torch.load(weights_only=False)``; gptrain's reader refuses all three crafts, runs nothing."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from gptrain.train.safe_dcp import UnsafeDCPMetadata, read_metadata_safely

    _, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    folder = ck / "iter_0000004"
    marker = tmp_path / "ran"
    metadata = read_metadata_safely(folder)
    if craft == "code":
        metadata.planner_data = _RunsCode(marker)
        why = "refuses to load posix.system"
    elif craft == "bytes-entry":
        key = next(k for k in metadata.state_dict_metadata if k.startswith("model/"))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        why = "BytesStorageMetadata"
    else:
        info = next(iter(metadata.storage_data.values()))
        info.relative_path = "../../state.json"
        why = "outside the checkpoint folder"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _restamp(folder)
    cfg, model = _model()
    with pytest.raises(UnsafeDCPMetadata, match=why):
        load_checkpoint(ck, dict(model.named_parameters()), None, cfg.model.vocab_size)
    assert not marker.exists()
    if craft == "code":  # the check is real: DCP's own reader runs it
        import torch.distributed.checkpoint as dcp

        dcp.FileSystemReader(folder).read_metadata()
        assert marker.exists()


# ---- issue 33: no silent fresh start, the saved config compared, checksums verified

def _errors(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc, _ = _train(argv)
    return rc, err.getvalue()


@pytest.mark.parametrize("case", ["no-tracker", "no-load"])
def test_a_folder_of_complete_checkpoints_is_resumed_not_trained_over(case, straight, tmp_path):
    """Without a tracker, or with --load left out, the newest complete checkpoint is resumed
    (one WARNING line), and the run goes on to the uninterrupted run's losses."""
    ref, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    if case == "no-tracker":
        (ck / TRACKER).unlink()
    argv = RUN + ["--train-iters", "6", "--save", str(ck)] + (["--load", str(ck)] if case == "no-tracker" else [])
    rc, lines = _train(argv)
    assert rc == 0
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert len(warnings) == 1 and "iter_0000004" in warnings[0], warnings
    assert f"  successfully loaded checkpoint from {ck} at iteration 4" in lines
    got = losses("\n".join(lines))
    assert sorted(got) == [5, 6] and all(got[i] == ref[i] for i in got), (got, ref)
    assert read_tracker(ck) == 6


def test_a_mistyped_load_or_another_runs_save_folder_stops_before_training(straight, tmp_path):
    _, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    def untouched():  # the checkpoints (the lock file names each run that takes it)
        return {p.name: p.stat().st_mtime_ns for p in ck.iterdir() if p.name not in (LOCK_NAME, PROGRESS_FILE)}

    before = untouched()
    rc, err = _errors(RUN + ["--train-iters", "6", "--load", str(tmp_path / "typo"), "--save", str(ck)])
    assert rc == 2 and err.strip() == (f"gptrain: error: --load {tmp_path / 'typo'} does not exist; --save {ck} "
                                       f"holds complete checkpoints (iter_0000004, iter_0000002): pass --load {ck}")
    older = tmp_path / "older"  # another run's folder, at iteration 2
    shutil.copytree(saved, older)
    shutil.rmtree(older / "iter_0000004")
    (older / TRACKER).write_text("2")
    rc, err = _errors(RUN + ["--train-iters", "6", "--load", str(older), "--save", str(ck)])
    assert rc == 2 and err.startswith(f"gptrain: error: --save {ck} holds complete checkpoints of another run newer "
                                      "than iteration 2 (iter_0000004; its tracker names 4)"), err
    assert untouched() == before and read_tracker(ck) == 4
    rc, err = _errors(RUN + ["--train-iters", "6", "--load", str(tmp_path / "typo")])
    assert rc == 2 and "does not exist (to start fresh and resume later, pass the same folder" in err


def test_resume_names_each_changed_architecture_setting(straight, tmp_path):
    """Megatron's check_checkpoint_args: 8 heads instead of 4 fit the same QKV shapes and would
    scramble them; the epsilon changes the function; --use-checkpoint-args takes the saved values."""
    _, saved = straight
    changed = [a for a in RUN if a not in ("--num-attention-heads", "4")] + [
        "--num-attention-heads", "8", "--layernorm-epsilon", "1e-6", "--train-iters", "4"]
    rc, err = _errors(changed + ["--load", str(saved)])
    assert rc == 2 and err.strip() == (
        f"gptrain: error: {saved}/iter_0000004 was trained with other settings: --num-attention-heads 4 in the "
        "checkpoint, 8 here; --layernorm-epsilon 1e-05 in the checkpoint, 1e-06 here; pass the checkpoint's values, "
        "or --use-checkpoint-args to take them from it"), err
    rc, lines = _train(changed + ["--load", str(saved), "--use-checkpoint-args"])
    assert rc == 0 and f"  successfully loaded checkpoint from {saved} at iteration 4" in lines
    assert " > --use-checkpoint-args: --num-attention-heads 4 (from iter_0000004; 8 on the command line)" in lines


@pytest.mark.parametrize("damage", ["shard-byte", ".metadata", "rng"])
def test_a_damaged_checkpoint_falls_back_to_the_older_one_with_one_line(damage, straight, tmp_path):
    """A flipped byte in a shard loads silently without checksums; a damaged .metadata or RNG
    header ends in a traceback. Each fails its checksum: the newest intact checkpoint is loaded."""
    _, saved = straight
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    name = {"shard-byte": "__0_0.distcp", ".metadata": ".metadata", "rng": "rng_rank00000.safetensors"}[damage]
    target = ck / "iter_0000004" / name
    data = bytearray(target.read_bytes())
    at = len(data) // 2 if damage == "shard-byte" else 4
    data[at] ^= 0x40
    target.write_bytes(bytes(data))
    cfg, model = _model()
    warned: list[str] = []
    state = load_checkpoint(ck, dict(model.named_parameters()), None, cfg.model.vocab_size, log=warned.append)
    assert state["iteration"] == 2
    assert warned == [f"WARNING: {ck}/iter_0000004 is damaged ({name} does not match its checksum): loading the "
                      "newest complete checkpoint, iter_0000002, instead"]
    manifest = json.loads((ck / "iter_0000002" / "state.json").read_text())
    assert sorted(manifest["checksums"]) == sorted(n for n in manifest["files"] if n != "state.json")


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_distributed_timeout(tmp_path):
    """--distributed-timeout-minutes was accepted and ignored (gloo waited its own 30 minutes): rank 1
    stops responding at iteration 3; rank 0 gives up after 6 s with one line and the run exits non-zero."""
    import socket
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "gptrain", "train", *TINY, "--train-iters", "5", "--distributed-timeout-minutes",
                           "0.1"], capture_output=True, text=True, timeout=300,
                          env={**_env(), "GPTRAIN_STALL_AT": "1@3"})
    assert done.returncode != 0 and time.monotonic() - start < 200
    errors = [line for line in done.stderr.splitlines() if line.startswith("gptrain:")]
    assert errors == [f"gptrain: error: rank 0 on {socket.gethostname()}: a collective waited longer than "
                      "--distributed-timeout-minutes 0.1 at iteration 3 (another rank stopped, hung or died); exiting "
                      "so the launcher can restart the group"], done.stderr[-3000:]
