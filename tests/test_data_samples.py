"""`gptrain data samples`: the tokens training reads at positions of a split, checked against
megatron-core's datasets built from the same flags."""
import numpy as np
import pytest

from gptrain.cli import main as cli
from test_data_megatron import megatron_datasets, tokens, write_dataset

SEQ, GBS, ITERS, INTERVAL, EVAL_ITERS, SEED = 16, 8, 40, 10, 2, 77


def train_flags(data_path, split):
    return ["--data-path", *data_path, "--split", split, "--seq-length", str(SEQ), "--max-position-embeddings",
            str(SEQ), "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--micro-batch-size",
            "4", "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--eval-interval", str(INTERVAL),
            "--eval-iters", str(EVAL_ITERS), "--seed", str(SEED), "--lr", "1e-4"]


def targets():
    return ITERS * GBS, (ITERS // INTERVAL + 1) * EVAL_ITERS * GBS, EVAL_ITERS * GBS


@pytest.mark.parametrize("blend", [False, True])
@pytest.mark.parametrize("split_name,index,start,count", [("train", 0, 0, 5), ("train", 0, 13 * GBS, GBS),
                                                          ("valid", 1, 3, 9)])
def test_samples_equal_megatron(tmp_path, capsys, blend, split_name, index, start, count):
    a = write_dataset(tmp_path / "a", 1500, 1)
    data_path = [a]
    if blend:
        data_path = ["0.35", a, "0.65", write_dataset(tmp_path / "b", 1300, 2)]
    out = tmp_path / "s.npy"
    argv = ["data", "samples", *train_flags(data_path, "949,50,1"), "--data-cache-path", str(tmp_path / "cache"),
            "--split-name", split_name, "--start", str(start), "--count", str(count), "--output", str(out)]
    assert cli(argv) == 0, capsys.readouterr().err
    got = np.load(out, allow_pickle=False)
    assert got.dtype == np.int64 and got.shape == (count, SEQ + 1)
    theirs = megatron_datasets(data_path, "949,50,1", SEQ, SEED, targets())[index]
    for k in range(count):
        i = start + k
        if blend:
            d = int(theirs.dataset_index[i])
            expected = tokens(theirs.datasets[d], int(theirs.dataset_sample_index[i]))
        else:
            expected = tokens(theirs, i)
        assert np.array_equal(got[k], expected), k
    assert f"wrote {out}" in capsys.readouterr().out


def test_samples_errors_are_one_line(tmp_path, capsys):
    a = write_dataset(tmp_path / "a", 300, 1)
    base = ["data", "samples", *train_flags([a], "100,0,0"), "--data-cache-path", str(tmp_path / "c")]
    assert cli(base + ["--split-name", "valid", "--start", "0", "--count", "1", "--output", str(tmp_path / "v.npy")]) == 2
    assert "valid split is empty" in capsys.readouterr().err
    assert cli(base + ["--start", "0", "--count", "1", "--output", str(tmp_path / "v.txt")]) == 2
    assert ".npy" in capsys.readouterr().err
    assert cli(base + ["--start", "-1", "--count", "1", "--output", str(tmp_path / "v.npy")]) == 2
    assert not list(tmp_path.glob("*.npy*"))
