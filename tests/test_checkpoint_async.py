"""--async-save: the checkpoints written in the background equal the synchronous ones bit for bit
(weights, AdamW state, RNG, run state), and each is published before the next save starts and
before the run ends."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.train.checkpoint import (CheckpointError, Checkpointer, HostStager, finish_save, init_optimizer_state,
                                      load_checkpoint, save_checkpoint)
from gptrain.train.checkpoint_files import is_complete, read_tracker
from gptrain.train.run import train_main
from gptrain.train.restart_note import PROGRESS_FILE
from gptrain.train.save_lock import LOCK_NAME

RUN = TINY + ["--save-interval", "2", "--lr-decay-iters", "6"]
# pytest resets warning filters per test; gptrain silences this one (one process is a normal run)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train(argv):
    lines: list[str] = []
    assert train_main(argv, log=lines.append).exit_code == 0, lines[-5:]
    return lines


def _snapshot(params, optimizer):
    tensors = {k: v.detach().clone() for k, v in params.items()}
    for k, p in params.items():
        tensors.update({f"{k}/{key}": v.clone() for key, v in optimizer.state[p].items()})
    return tensors


def _model():
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    params = dict(model.named_parameters())
    return cfg, model, params, torch.optim.AdamW(params.values())


def _everything(folder):
    cfg, _, params, optimizer = _model()
    state = load_checkpoint(folder, params, optimizer, cfg.model.vocab_size, load_rng=False)
    return _snapshot(params, optimizer), state


def _step(model, optimizer, vocab_size, seed):
    """One real AdamW step on random tokens: every weight and moment changes."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (2, 33), generator=g)
    logits = model.logits(tokens[:, :-1])[..., :vocab_size]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_consecutive_async_saves_are_each_published_with_their_own_values(tmp_path, monkeypatch):
    """Several async saves through one Checkpointer (with torch 2.11's DefaultStager the second one
    failed): each is published, loads the values of its own iteration although training changed them
    before the write finished, and reuses the first save's staging buffers."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def stage_as_in_torch_2_11(self, state_dict, **kwargs):  # pytorch#183413: its stage closed it
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_as_in_torch_2_11)
    torch.manual_seed(0)
    cfg, model, params, optimizer = _model()
    vocab = cfg.model.vocab_size
    _step(model, optimizer, vocab, 0)  # AdamW state exists
    saver = Checkpointer(True, log=lambda line: None)
    expected, buffers = {}, []
    for it in (1, 2, 3):
        expected[it] = _snapshot(params, optimizer)
        saver.save(tmp_path, it, params, optimizer, {"config": {}}, vocab)
        buffers.append({k: v.data_ptr() for k, v in saver._stager.buffers.items()})
        _step(model, optimizer, vocab, it)  # training goes on while the writer thread writes
        if it == 2:
            saver.poll()  # publishes it if the writer is done, else the next save does
    saver.close()
    assert buffers[0] == buffers[1] == buffers[2]
    assert read_tracker(tmp_path) == 3
    first = next(iter(expected[1]))
    assert not torch.equal(expected[1][first], expected[3][first])  # the saves hold different values
    for it in (1, 2, 3):
        assert is_complete(tmp_path / f"iter_{it:07d}")[0]
        _assert_checksums(tmp_path / f"iter_{it:07d}")
        alone = tmp_path / f"alone{it}"  # a root whose tracker names this iteration
        alone.mkdir()
        (alone / f"iter_{it:07d}").symlink_to(tmp_path / f"iter_{it:07d}")
        (alone / "latest_checkpointed_iteration.txt").write_text(str(it))
        got, _ = _everything(alone)
        assert sorted(got) == sorted(expected[it])
        for k in got:  # the vocabulary padding rows are not stored
            cut = slice(vocab) if k.startswith("word_embeddings.weight") and got[k].dim() == 2 else ...
            assert torch.equal(got[k][cut], expected[it][k][cut]), (it, k)


def test_a_failing_save_names_the_underlying_exception(tmp_path):
    """The one line of a failed save names the exception (type, message, where), whether it is
    raised while staging (the torch 2.11 failure: a DefaultStager whose stage had closed it) or in
    DCP's writer thread (per rank); the partial files go, the previous checkpoint stays."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cfg, _, params, optimizer = _model()
    init_optimizer_state(params, optimizer)
    vocab = cfg.model.vocab_size
    save_checkpoint(tmp_path, 1, params, optimizer, {}, vocab)
    closed = DefaultStager(StagingOptions(False, False, False, False))
    closed.close()
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 2, params, optimizer, {}, vocab, async_save=True, stager=closed)
    assert "iteration 2" in str(err.value) and "KeyError: <class 'type'> (at _state_dict_stager.py:" in str(err.value)
    assert str(err.value).endswith(f"the newest complete checkpoint is {tmp_path / 'iter_0000001'}")

    class Unpicklable(HostStager):  # DCP pickles non-tensor values in its writer thread
        def stage(self, state_dict):
            return {**super().stage(state_dict), "extra": lambda: 0}

    pending = save_checkpoint(tmp_path, 3, params, optimizer, {}, vocab, async_save=True, stager=Unpicklable(False))
    with pytest.raises(CheckpointError, match=r": rank 0: \w+: Can't (pickle|get) local object .*<lambda>.* "
                                              r"\(at \w+\.py:\d+ in \w+\); its partial files were removed"):
        finish_save(pending)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    _train(RUN + ["--train-iters", "4", "--save", str(root / "sync")])
    return root / "sync"


@pytest.mark.slow
def test_async_checkpoints_equal_sync_ones(sync_run, tmp_path):
    """Equal contents: a resume from them is the synchronous resume, tested exactly elsewhere."""
    lines = _train(RUN + ["--train-iters", "4", "--save", str(tmp_path / "async"), "--async-save"])
    published = [i for i, x in enumerate(lines) if x.startswith("  successfully saved checkpoint at iteration")]
    started = [i for i, x in enumerate(lines) if x.startswith("saving checkpoint at iteration")]
    assert len(published) == len(started) == 2 and published[0] < started[1]  # one save at a time
    assert any(x.startswith("  training blocked ") for x in lines)
    assert read_tracker(tmp_path / "async") == 4
    for it in (2, 4):
        a, b = sync_run / f"iter_{it:07d}", tmp_path / "async" / f"iter_{it:07d}"
        assert is_complete(b)[0]
        assert (a / "rng_rank00000.safetensors").read_bytes() == (b / "rng_rank00000.safetensors").read_bytes()
    x, sx = _everything(sync_run)
    y, sy = _everything(tmp_path / "async")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    drop = ("files", "config", "checksums")
    assert {k: v for k, v in sx.items() if k not in drop} == {k: v for k, v in sy.items() if k not in drop}
    # the shards hash alike; DCP's .metadata records the folder it was written to, so it differs
    assert {k: v for k, v in sx["checksums"].items() if k != ".metadata"} == \
        {k: v for k, v in sy["checksums"].items() if k != ".metadata"}


def _assert_checksums(folder) -> list[str]:
    """The manifest's sha256 of every file but itself, hashed by the writing ranks after the write."""
    import hashlib
    import json

    manifest = json.loads((folder / "state.json").read_text())
    assert sorted(manifest["checksums"]) == sorted(n for n in manifest["files"] if n != "state.json")
    for name, digest in manifest["checksums"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    return sorted(manifest["checksums"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 1], ids=["zero3", "zero1-distributed-optimizer"])
def test_async_save_under_zero_on_two_ranks(stage, sync_run, tmp_path):
    """Two ranks write their shards in the background (their own gloo group) and agree on when the
    checkpoint is published; it holds bit for bit what the same layout saves synchronously, and the
    one-process run's weights up to the two ranks' summation order. The distributed optimizer's rows are
    views into one buffer (the host copies are made apart from it)."""
    from distributed import torchrun

    zero3 = RUN + ["--train-iters", "4", "--zero-stage", str(stage)]
    out = torchrun(2, zero3 + ["--async-save", "--save", str(tmp_path / "two")])
    assert out.count("  successfully saved checkpoint at iteration") == 2 and read_tracker(tmp_path / "two") == 4
    assert is_complete(tmp_path / "two" / "iter_0000002")[0] and is_complete(tmp_path / "two" / "iter_0000004")[0]
    assert {name[:4] for name in _assert_checksums(tmp_path / "two" / "iter_0000004")} >= {"__0_", "__1_", "rng_"}
    torchrun(2, zero3 + ["--save", str(tmp_path / "two-sync")])
    x, _ = _everything(sync_run)
    y, state = _everything(tmp_path / "two")
    z, _ = _everything(tmp_path / "two-sync")
    assert state["layout"]["dp"] == 2 and state["layout"]["zero_stage"] == stage
    assert sorted(y) == sorted(z) and all(torch.equal(y[k], z[k]) for k in y)
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_signal_during_a_background_save_still_publishes_it(tmp_path, monkeypatch):
    """SIGTERM without --exit-signal-handler while iteration 2's save is still being written: the
    run stops with the signal's status, and iteration 2 is published complete, not dropped."""
    import os
    import signal
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    plain_write = FileSystemWriter.write_data
    signalled = threading.Event()

    def gated_write(self, *args, **kw):
        assert signalled.wait(300)  # the save is still pending when the signal comes, however slow the machine
        return plain_write(self, *args, **kw)

    monkeypatch.setattr(FileSystemWriter, "write_data", gated_write)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith(f" iteration {3:8d}/"):
            signalled.set()
            os.kill(os.getpid(), signal.SIGTERM)

    ck = tmp_path / "ck"
    rc = train_main(RUN + ["--train-iters", "100", "--async-save", "--save", str(ck)], log=log).exit_code
    assert rc == 128 + signal.SIGTERM
    assert not any("successfully saved checkpoint at iteration       2" in x for x in lines[:-1])
    assert lines[-2].startswith("  waiting for the background save of iteration 2"), "\n".join(lines[-6:])
    assert "finished after the signal" in lines[-1] and "iteration       2" in lines[-1], "\n".join(lines[-6:])
    assert read_tracker(ck) == 2 and is_complete(ck / "iter_0000002")[0]
    assert sorted(p.name for p in ck.iterdir() if p.name not in (LOCK_NAME, PROGRESS_FILE)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_signal_while_a_background_save_is_staged_still_publishes_it(tmp_path, monkeypatch):
    """SIGTERM while training is blocked for the copy into host buffers (iteration 4's save): it takes
    effect once the save is recorded as pending, so that save is published too, not left half-way."""
    import os
    import signal

    from gptrain.train import checkpoint as ckpt

    plain_stage = ckpt.HostStager.stage
    staged: list[int] = []

    def stage(self, state_dict):
        staged.append(1)
        out = plain_stage(self, state_dict)
        if len(staged) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(ckpt.HostStager, "stage", stage)
    lines: list[str] = []
    ck = tmp_path / "ck"
    rc = train_main(RUN + ["--train-iters", "100", "--async-save", "--save", str(ck)], log=lines.append).exit_code
    assert rc == 128 + signal.SIGTERM
    assert "finished after the signal" in lines[-1] and "iteration       4" in lines[-1], "\n".join(lines[-6:])
    assert read_tracker(ck) == 4 and is_complete(ck / "iter_0000004")[0]
    assert sorted(p.name for p in ck.iterdir() if p.name not in (LOCK_NAME, PROGRESS_FILE)) == ["iter_0000002", "iter_0000004",
                                                                         "latest_checkpointed_iteration.txt"]
