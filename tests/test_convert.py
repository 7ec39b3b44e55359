"""gptrain convert (to and from Hugging Face GPT-2, from Megatron-LM) and --load of an HF folder,
checked against transformers' own GPT2LMHeadModel and tokenizer reading the written files offline."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import TINY, losses
from gptrain.cli import main
from gptrain.interop.convert import read_gptrain
from gptrain.interop.hf import load_hf_folder
from gptrain.train.checkpoint_files import read_tracker
from gptrain.train.run import train_main

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt"
TEXT = "Checkpoints that never lose work, read by transformers without a network."


def _train(argv):
    lines: list[str] = []
    rc = train_main(argv, log=lines.append).exit_code
    return rc, lines


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    rc, _ = _train(TINY + ["--train-iters", "3", "--save", str(root / "ck")])
    assert rc == 0
    return root


@pytest.fixture(scope="module")
def hf_folder(trained):
    out = trained / "hf"
    assert main(["convert", "--to", "hf", str(trained / "ck"), str(out)]) == 0
    return out


def test_to_hf_loads_offline_in_transformers_with_equal_logits(trained, hf_folder, capsys, tokenizer):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    assert sorted(p.name for p in hf_folder.iterdir()) == [
        "config.json", "generation_config.json", "merges.txt", "model.safetensors", "special_tokens_map.json",
        "tokenizer_config.json", "vocab.json"]
    umask = os.umask(0)
    os.umask(umask)
    files = [*hf_folder.iterdir(), *(trained / "ck").glob("iter_*/*")]  # the RNG and weight files included
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}
    weights = load_file(hf_folder / "model.safetensors")
    assert weights["transformer.wte.weight"].shape == (50257, 32)  # the padding rows are gone
    hf_tok = AutoTokenizer.from_pretrained(hf_folder, local_files_only=True)
    ids = hf_tok(TEXT)["input_ids"]
    assert ids == tokenizer.encode(TEXT) and hf_tok.eos_token_id == tokenizer.eod
    hf = GPT2LMHeadModel.from_pretrained(hf_folder, local_files_only=True).eval()
    ours, _ = read_gptrain(trained / "ck")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf(tokens).logits
        mine = ours.eval().logits(tokens)[..., :50257]
    torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-4)
    assert main(["convert", "--to", "hf", str(trained / "ck"), str(hf_folder)]) == 2  # never over an existing folder
    assert "exists: give a new folder" in capsys.readouterr().err


@pytest.mark.slow
def test_from_hf_round_trip_and_training_from_it(trained, hf_folder, capsys):
    out = trained / "from_hf"
    assert main(["convert", "--from", "hf", str(hf_folder), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "transformers' GPT2LMHeadModel reading DIR: max abs difference" in printed and f"wrote {out}" in printed
    assert read_tracker(out) == "release"
    original, _ = read_gptrain(trained / "ck")
    back, _ = read_gptrain(out)
    assert all(torch.equal(p, back.get_parameter(k)) for k, p in original.named_parameters())
    # the converted checkpoint, the HF folder itself and the original weights (--finetune) train alike
    runs = {}
    for name, load in (("converted", [str(out)]), ("hf", [str(hf_folder)]), ("ck", [str(trained / "ck"), "--finetune"])):
        rc, lines = _train(TINY + ["--train-iters", "2", "--load", *load])
        assert rc == 0, lines[-3:]
        runs[name] = losses("\n".join(lines))
    assert sorted(runs["hf"]) == [1, 2] and runs["hf"] == runs["converted"] == runs["ck"]


def test_load_of_an_hf_folder_checks_the_architecture(hf_folder, capsys):
    assert TINY[:2] == ["--num-layers", "2"]
    rc, _ = _train(["--num-layers", "3"] + TINY[2:] + ["--train-iters", "1", "--load", str(hf_folder)])
    assert rc == 2
    assert f"--num-layers 3 contradicts the checkpoint's num_layers 2 ({hf_folder}/config.json)" in capsys.readouterr().err


def test_pickled_hf_weights_are_refused(tmp_path, hf_folder):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is a pickle and is not read"):
        load_hf_folder(folder)


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="the Megatron-LM fixtures live in ../shared (not in CI's clone)")
def test_from_megatron_writes_a_checkpoint_with_its_iteration_and_weights(tmp_path, capsys):
    from gptrain.interop.megatron import read_megatron_checkpoint

    out = tmp_path / "m"
    assert main(["convert", "--from", "megatron", str(FIXTURES / "dev_pp2"), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the gptrain checkpoint read back vs the Megatron weights: max abs difference" in printed
    assert "note: the 47 padding rows of the word embeddings are dropped" in printed
    assert read_tracker(out) == 20
    state = json.loads((out / "iter_0000020" / "state.json").read_text())
    assert state["consumed_train_samples"] == 160 and "TP1 x PP2" in state["source"]
    model, _ = read_gptrain(out)
    source = read_megatron_checkpoint(FIXTURES / "dev_pp2").model_state_dict()
    for name, p in model.named_parameters():
        ref = source[name].float()[:50257]  # the real vocabulary's rows (Megatron's padding rows are dropped)
        torch.testing.assert_close(p[: ref.shape[0]], ref, rtol=0, atol=0, msg=name)
