"""One run per --save folder (issue 33, defect 10): a second `gptrain train` on a folder another run
is saving into stops in one line naming the holder, before anything there is written or cleaned; a
killed run leaves no stale lock; the lock file is no checkpoint content to any reader."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from distributed import TINY, _env
from gptrain.checkpoint_kind import checkpoint_kind
from gptrain.train.checkpoint_files import complete_checkpoints, find_gptrain_iteration_dir, read_tracker, recover
from gptrain.train.run import train_main
from gptrain.train.save_lock import LOCK_NAME, FolderInUse, lock_save_folder, release_all

HOLD = "import sys, time; from gptrain.train.save_lock import lock_save_folder; lock_save_folder(sys.argv[1]); " \
       "print('held', flush=True); time.sleep(600)"


def _holder(folder) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_the_lock_is_exclusive_between_processes_and_dies_with_its_holder(tmp_path):
    folder = tmp_path / "ck"
    proc = _holder(folder)
    try:
        with pytest.raises(FolderInUse, match=rf"--save {folder} is in use by another gptrain run \(held by pid "
                                              rf"{proc.pid} on {socket.gethostname()}\)"):
            lock_save_folder(folder)
    finally:
        proc.kill()
        proc.wait()
    lock_save_folder(folder)  # SIGKILL left no stale lock
    release_all()


def test_recover_leaves_a_folder_another_run_holds_alone(tmp_path):
    folder = tmp_path / "ck"
    proc = _holder(folder)
    (folder / ".iter_0000004.tmp").mkdir()  # that run's save in progress
    lines = []
    try:
        recover(folder, lines.append)
        assert (folder / ".iter_0000004.tmp").is_dir()
        assert lines == [f"WARNING: {folder} is in use by another gptrain run (held by pid {proc.pid} on "
                         f"{socket.gethostname()}): its temporary folders are left alone"]
    finally:
        proc.kill()
        proc.wait()
    recover(folder, lines.append)
    assert not (folder / ".iter_0000004.tmp").exists()


@pytest.mark.slow
def test_a_second_run_on_the_same_save_stops_and_the_first_ones_save_survives(tmp_path, capsys):
    ck = tmp_path / "ck"
    argv = TINY + ["--save", str(ck), "--load", str(ck), "--save-interval", "2"]
    with open(tmp_path / "first.err", "w") as err:  # stops responding at iteration 3, holding the lock
        first = subprocess.Popen([sys.executable, "-m", "gptrain", "train", *argv, "--train-iters", "100"],
                                 stdout=subprocess.DEVNULL, stderr=err, text=True,
                                 env={**_env(), "GPTRAIN_STALL_AT": "0@3"})
    try:
        deadline = time.monotonic() + 240
        while read_tracker(ck) != 2:
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.err").read_text()[-3000:]
            time.sleep(0.2)
        in_progress = ck / ".iter_0000004.tmp"  # stands for the first run's next save, being written
        in_progress.mkdir()
        (in_progress / "__0_0.distcp").write_bytes(b"data")
        assert train_main(argv + ["--train-iters", "4"], log=lambda _: None).exit_code == 2
        assert capsys.readouterr().err.strip() == (
            f"gptrain: error: --save {ck} is in use by another gptrain run (held by pid {first.pid} on "
            f"{socket.gethostname()}): two runs saving into one folder would delete each other's saves; wait for "
            "it to end, or pass another --save")
        assert (in_progress / "__0_0.distcp").read_bytes() == b"data" and read_tracker(ck) == 2
    finally:
        first.kill()
        first.wait()
    # the killed run's lock went with it: the next run resumes, cleaning what the killed save left
    lines: list[str] = []
    assert train_main(argv + ["--train-iters", "4"], log=lines.append).exit_code == 0
    assert read_tracker(ck) == 4 and not in_progress.exists()
    assert any("removed 1 temporary folder(s) of interrupted saves" in line for line in lines)
    # the lock file stays, and no reader takes it for a checkpoint
    assert (ck / LOCK_NAME).is_file()
    assert checkpoint_kind(ck) == "gptrain" and [p.name for p in complete_checkpoints(ck)] == ["iter_0000004",
                                                                                               "iter_0000002"]
    assert find_gptrain_iteration_dir(ck).name == "iter_0000004"
    only_lock = tmp_path / "fresh"
    lock_save_folder(only_lock)
    release_all()
    assert checkpoint_kind(only_lock, none_ok=True) is None and complete_checkpoints(only_lock) == []
    lines = []
    assert train_main(TINY + ["--save", str(only_lock), "--train-iters", "1"], log=lines.append).exit_code == 0
    assert not any(line.startswith("WARNING") for line in lines) and read_tracker(only_lock) == 1


def test_a_file_system_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from gptrain.train import save_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    save_lock.lock_save_folder(tmp_path / "save")
    assert "does not support flock" in capsys.readouterr().err
    assert not save_lock.holds(tmp_path / "save")
