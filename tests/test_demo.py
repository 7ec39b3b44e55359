"""`gptrain demo`: its verdict on the training run's result, its loss curve, and two short CPU runs (one
bounded by iterations, one stopped by its time limit and evaluated from the checkpoint)."""
from __future__ import annotations

import re
import struct

import pytest

from gptrain import demo


def test_the_verdict():
    assert demo.loss_fell([(5, 10.5), (10, 9.0), (15, 7.25)]) == (
        True, "lm loss 10.500 (first training interval) -> 7.250 (last training interval): fell by 3.250; "
              "the demo requires 2.0")
    assert demo.loss_fell([(5, 10.5), (10, 9.0)])[0] is False
    assert demo.loss_fell([(5, 10.5)]) == (False, "only 1 logged interval(s): too few iterations to see the loss fall")
    # the final validation loss, when there is one, is the measure: held out, and less noisy
    assert demo.loss_fell([(5, 10.5), (10, 9.0)], 8.25) == (
        True, "lm loss 10.500 (first training interval) -> 8.250 (final validation): fell by 2.250; "
              "the demo requires 2.0")
    assert demo.loss_fell([(5, 10.5), (10, 7.0)], 9.0)[0] is False
    assert demo.loss_fell([], 5.0)[0] is False


def test_loss_curve_is_a_png_matplotlib_reads_back(tmp_path):
    import matplotlib.image

    path = tmp_path / "curve.png"
    message = demo.plot_losses(path, [(5, 10.5), (10, 9.0), (15, 7.25)],
                               {"val": [(10, 9.5), (15, 7.5)], "test": [(15, 7.75)]}, "title")
    assert message == f"loss curve: {path}"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (800, 500)
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (500, 800) and image.std() > 0.05  # a drawing, not a blank canvas


def _run_demo(tmp_path, capsys, *flags):
    rc = demo.demo_main(["--out", str(tmp_path / "demo"), "--cpu", *flags])
    return rc, capsys.readouterr().out


@pytest.mark.slow
def test_demo_on_cpu_trains_evaluates_samples_and_draws(tmp_path, capsys):
    rc, out = _run_demo(tmp_path, capsys, "--train-iters", "16")
    assert rc == 0, out[-3000:]
    # validation and test splits of tens of documents (90,5,5 of the corpus)
    split = re.search(r"validation:\n     document indices in \[\d+, \d+\) total of (\d+) documents\n    test:\n"
                      r"     document indices in \[\d+, \d+\) total of (\d+) documents", out)
    assert split and all(20 <= int(n) <= 200 for n in split.groups())
    assert re.search(r"validation loss at the end of training for val data \| lm loss value: \S+ \| lm loss PPL:", out)
    assert re.search(r"validation loss at the end of training for test data \| lm loss value: \S+ \| lm loss PPL:", out)
    samples = re.findall(r"== sample \(temperature 0\.9, top-k 40\) for '([^']+)':\n(.*?)\n(?=== )", out, re.S)
    assert [p for p, _ in samples] == list(demo.PROMPTS)
    assert all(text.startswith(prompt) for prompt, text in samples)
    # sampled text, not blank lines (16 CPU iterations make a near-unigram model: words in any order)
    assert len(re.findall(r"[A-Za-z]{2,}", "".join(text[len(p):] for p, text in samples))) >= 5, samples
    assert len({text[len(p):] for p, text in samples}) == 3  # one seed per prompt
    assert re.search(r"== lm loss [\d.]+ \(first training interval\) -> [\d.]+ \(final validation\): fell by "
                     r"[\d.]+; the demo requires 2\.0", out)
    assert (tmp_path / "demo" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "demo" / "tensorboard").iterdir())
    assert f"tensorboard --logdir {tmp_path / 'demo' / 'tensorboard'}" in out
    assert "TFLOP/s" not in out and "gptrain demo: OK" in out


@pytest.mark.slow
def test_demo_time_limit_still_evaluates_the_checkpoint(tmp_path, capsys):
    rc, out = _run_demo(tmp_path, capsys, "--train-iters", "1000", "--minutes", "0.05")
    assert "exiting program after 0.05 minutes" in out
    assert re.search(r"== the 0\.05-minute limit stopped training at iteration \d+; evaluating the checkpoint", out)
    assert re.search(r"validation loss at the end of training for val data \| lm loss value: \S+", out)
    assert re.search(r"validation loss at the end of training for test data \| lm loss value: \S+", out)
    # the verdict and the exit status agree, whatever this machine's speed allowed
    assert (rc == 0) == ("gptrain demo: OK" in out) and (rc == 1) == ("gptrain demo: FAILED" in out)


def test_whitespace_flattened_prose_joined_code_kept():
    text = ("Title\n*****\n\nA paragraph of prose that was hard-wrapped at seventy\n"
            "characters by the documentation build, as  pydoc writes it.\n\n"
            "   Indented prose of the same kind, wrapped over two lines by\n"
            "   the same tool, and indented by three spaces everywhere.\n\n"
            "   >>> x = [1,  2]\n   >>> len(x)\n   2\n\n   for i in x:\n       print(i)")
    assert demo.flatten_whitespace(text) == (
        "Title\n*****\n\nA paragraph of prose that was hard-wrapped at seventy characters by the documentation "
        "build, as pydoc writes it.\n\nIndented prose of the same kind, wrapped over two lines by the same tool, "
        "and indented by three spaces everywhere.\n\n>>> x = [1, 2]\n>>> len(x)\n2\n\nfor i in x:\nprint(i)")


def test_demo_refuses_to_replace_a_folder_that_is_not_a_demo(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert demo.demo_main(["--out", str(tmp_path), "--cpu"]) == 2
    assert "holds files that are not a previous demo's" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_busy_cpu_trains_on_one_thread(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    try:
        monkeypatch.setattr(demo.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
        assert demo.busy_cpu_threads() is None and torch.get_num_threads() == threads
        monkeypatch.setattr(demo.os, "getloadavg", lambda: (7.25, 6.0, 5.0))
        assert demo.busy_cpu_threads() == ("busy CPU (load average 7.2 on 2 cores): one thread"
                                           if threads > 1 else None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
