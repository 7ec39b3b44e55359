"""Megatron-LM's torch_dist checkpoints (its default --ckpt-format): the real fixture written by
Megatron-LM reads as the same run saved in the legacy format, and a folder whose pickles would run
code is refused with nothing run."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gptrain.checkpoint_kind import checkpoint_kind
from gptrain.interop.megatron import read_megatron_checkpoint
from gptrain.interop.safe_unpickle import UnsafeCheckpointError
from gptrain.train.safe_dcp import UnsafeDCPMetadata

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt"
needs_fixture = pytest.mark.skipif(not (FIXTURES / "dev_dist_tp1").is_dir(),
                                   reason=f"Megatron checkpoint fixtures not found at {FIXTURES} (../shared)")


@needs_fixture
def test_torch_dist_fixture_reads_as_the_legacy_save_of_the_same_run():
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (FIXTURES / "dev_dist_tp1").rglob("*"))
    dist = read_megatron_checkpoint(FIXTURES / "dev_dist_tp1")
    legacy = read_megatron_checkpoint(FIXTURES / "dev_tp1")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (FIXTURES / "dev_dist_tp1").rglob("*")) == before
    assert checkpoint_kind(FIXTURES / "dev_dist_tp1") == "megatron"
    assert dist.iteration == 20 and (dist.tp, dist.pp) == (1, 1) and dist.layout == "megatron-core torch_dist"
    assert dist.args["consumed_train_samples"] == 160 and dist.args["num_layers"] == 2
    assert sorted(dist.state) == sorted(legacy.state)
    for name, tensor in dist.state.items():
        assert torch.equal(tensor, legacy.state[name]), name  # the same run, saved in the other format
    # an iteration folder itself is accepted too
    assert read_megatron_checkpoint(FIXTURES / "dev_dist_tp1" / "iter_0000020").iteration == 20


@needs_fixture
def test_convert_from_a_torch_dist_checkpoint(tmp_path, capsys):
    from gptrain.cli import main
    from gptrain.interop.convert import read_gptrain

    out = tmp_path / "g"
    assert main(["convert", "--from", "megatron", str(FIXTURES / "dev_dist_tp1"), str(out)]) == 0
    assert "max abs difference" in capsys.readouterr().out
    model, state = read_gptrain(out)
    source = read_megatron_checkpoint(FIXTURES / "dev_dist_tp1").model_state_dict()
    for name, p in model.named_parameters():
        ref = source[name].float()[:50257]
        torch.testing.assert_close(p[: ref.shape[0]], ref, rtol=0, atol=0, msg=name)


class _RunsCode:
    def __reduce__(self):
        return os.system, (f"touch {_RunsCode.marker}",)


def _torch_dist_folder(root: Path, common) -> Path:
    # DCP torch.saves a non-tensor value into a byte entry, as Megatron's common state is stored
    folder = root / "iter_0000001"
    state = {"embedding.word_embeddings.weight": torch.zeros(8, 4), "common_state/shard_0_1": common}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return folder


def test_a_torch_dist_folder_whose_pickles_run_code_is_refused(tmp_path):
    _RunsCode.marker = tmp_path / "ran"
    folder = _torch_dist_folder(tmp_path / "common", [{"args": _RunsCode(), "iteration": 1}])
    assert checkpoint_kind(tmp_path / "common") == "megatron"
    with pytest.raises(UnsafeCheckpointError, match="refuses to load posix.system"):
        read_megatron_checkpoint(tmp_path / "common")
    assert not _RunsCode.marker.exists()

    # the .metadata pickle itself naming a callable
    shutil.copytree(folder.parent, tmp_path / "meta")
    with open(tmp_path / "meta" / "iter_0000001" / ".metadata", "wb") as f:
        import pickle
        pickle.dump(_RunsCode(), f)
    with pytest.raises(UnsafeDCPMetadata, match="refuses to load posix.system"):
        read_megatron_checkpoint(tmp_path / "meta")
    assert not _RunsCode.marker.exists()


def test_ckpt_format_names_what_gptrain_writes():
    from gptrain.config import parse_megatron_args

    parse_megatron_args(["--ckpt-format", "torch_dist", "--mock-data", "--train-iters", "1"])  # gptrain's DCP folders: accepted
    with pytest.raises(ValueError, match="--ckpt-format torch: only torch_dist .* convert --to megatron"):
        parse_megatron_args(["--ckpt-format", "torch", "--mock-data", "--train-iters", "1"])


def test_an_older_torch_dist_folder_with_a_pickled_common_pt_is_refused(tmp_path):
    # Megatron-LM before the common_state entry kept its common state in common.pt beside the shards
    _RunsCode.marker = tmp_path / "ran"
    folder = tmp_path / "old" / "iter_0000001"
    dcp.save({"embedding.word_embeddings.weight": torch.zeros(8, 4)}, storage_writer=dcp.FileSystemWriter(str(folder)),
             no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (tmp_path / "old" / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": _RunsCode(), "iteration": 1}, folder / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match="refuses to load posix.system"):
        read_megatron_checkpoint(tmp_path / "old")
    assert not _RunsCode.marker.exists()


def test_optimizer_and_rng_entries_of_a_torch_dist_folder_are_passed_over(tmp_path):
    # the model's tensors are read; megatron-core's optimizer state (plain or chained), schedule and RNG are not
    from gptrain.interop.megatron_dist import model_keys
    from gptrain.train.safe_dcp import read_metadata_safely

    folder = tmp_path / "iter_0000001"
    state = {"embedding.word_embeddings.weight": torch.zeros(8, 4),
             "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.zeros(8, 4),
             "chained_0.optimizer.state.exp_avg_sq.embedding.word_embeddings.weight": torch.zeros(8, 4),
             "rng_state/shard_0_1": [{"random_rng_state": 1}], "opt_param_scheduler": {"num_steps": 3}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    assert list(model_keys(folder, read_metadata_safely(folder, allow_bytes=True))) == [
        "embedding.word_embeddings.weight"]


@needs_fixture
def test_generate_and_serve_read_a_torch_dist_checkpoint():
    from gptrain.inference.load import load_for_inference

    dist, legacy = load_for_inference(FIXTURES / "dev_dist_tp1"), load_for_inference(FIXTURES / "dev_tp1")
    assert dist.kind == "megatron"
    tokens = torch.randint(0, 50257, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(dist.model.logits(tokens), legacy.model.logits(tokens))
