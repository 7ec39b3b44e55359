"""checkpoint_kind: the one decision of which kind of checkpoint a folder holds (training's --load,
inference, convert), and convert's error for a folder of another kind."""
from __future__ import annotations

from pathlib import Path

import pytest

from gptrain.checkpoint_kind import TRACKER, NoCheckpoint, checkpoint_kind
from gptrain.interop.convert import convert_main

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt"


def _folder(root: Path, tracker: str | None = None, iteration_dir: str | None = None, files=()) -> Path:
    root.mkdir(parents=True)
    if tracker is not None:
        (root / TRACKER).write_text(tracker)
    if iteration_dir is not None:
        (root / iteration_dir).mkdir(parents=True)
    for name in files:
        (root / name).write_text("{}")
    return root


def test_each_kind_and_none(tmp_path):
    assert checkpoint_kind(_folder(tmp_path / "m", "20", "iter_0000020/mp_rank_00")) == "megatron"
    assert checkpoint_kind(_folder(tmp_path / "r", "release", "release/mp_rank_00_000")) == "megatron"
    assert checkpoint_kind(_folder(tmp_path / "g", "20", "iter_0000020", files=[".metadata"])) == "gptrain"
    assert checkpoint_kind(_folder(tmp_path / "h", files=["config.json"])) == "huggingface"
    # a tracker wins over a config.json beside it; a bad tracker is gptrain's reader's to name
    assert checkpoint_kind(_folder(tmp_path / "gh", "3", "iter_0000003", files=["config.json"])) == "gptrain"
    assert checkpoint_kind(_folder(tmp_path / "bad", "latest")) == "gptrain"
    with pytest.raises(NoCheckpoint, match="no such checkpoint"):
        checkpoint_kind(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="neither a gptrain/Megatron checkpoint .* nor a Hugging Face folder"):
        checkpoint_kind(_folder(tmp_path / "empty"))
    assert checkpoint_kind(tmp_path / "nowhere", none_ok=True) is None  # training's --save before its first save
    if FIXTURES.is_dir():
        assert checkpoint_kind(FIXTURES / "dev_tp1") == "megatron"


def test_convert_names_the_kind_it_was_given(tmp_path, capsys):
    hf = _folder(tmp_path / "h", files=["config.json"])
    assert convert_main(["--to", "hf", str(hf), str(tmp_path / "out")]) == 2
    assert f"{hf} is a huggingface checkpoint, not a gptrain one (convert it with --from hf)" in capsys.readouterr().err
    megatron = _folder(tmp_path / "m", "20", "iter_0000020/mp_rank_00")
    assert convert_main(["--from", "hf", str(megatron), str(tmp_path / "out")]) == 2
    assert "is a megatron checkpoint, not a huggingface one (convert it with --from megatron)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
