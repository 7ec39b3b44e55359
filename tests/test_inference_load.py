"""Loading for inference from a HF GPT-2 folder, a Megatron-LM folder and a gptrain checkpoint, and
`gptrain generate` against transformers' greedy output."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gptrain.cli import main
from gptrain.inference.load import load_for_inference
from gptrain.model.gpt import GPT, GPTConfig
from tiny import tiny_config
from gptrain.tokenizer import GPT2Tokenizer

transformers = pytest.importorskip("transformers")


def tiny_cfg(**kw) -> GPTConfig:
    return tiny_config(ffn_hidden_size=128, seq_length=16, max_position_embeddings=16, vocab_size=50257,
                       init_method_std=0.2, **kw)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from gptrain.interop.hf import hf_config_kwargs, to_hf_state_dict

    model = GPT(tiny_cfg())
    model.init_weights(11)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(model.cfg))).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf


def test_hf_folder_and_generate_command(hf_folder, capsys):
    folder, hf = hf_folder
    loaded = load_for_inference(folder)
    assert loaded.kind == "huggingface"
    tokens = torch.tensor([[464, 1351, 286, 262, 995]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.logits(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
        hf.generation_config.eos_token_id = None
        expected = hf.generate(tokens, max_new_tokens=8, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones_like(tokens))[0, 5:].tolist()
    tok = GPT2Tokenizer()
    prompt = tok.decode(tokens[0].tolist())
    assert main(["generate", "--load", str(folder), "--prompt", prompt, "--greedy", "--tokens-to-generate", "8"]) == 0
    out = capsys.readouterr().out
    # the command stops at <|endoftext|>, as the server does
    if tok.eod in expected:
        expected = expected[: expected.index(tok.eod)]
    assert out == prompt + tok.decode(expected) + "\n"


def test_the_generate_command_as_a_process(hf_folder, capsys):
    """`python -m gptrain generate` (the command's own process, which leaves without the interpreter's
    teardown) prints what the command prints in process, and its one start-up line; a reader that goes
    away early (`| head -c 1`) ends it without a traceback."""
    import subprocess
    import sys

    folder, _ = hf_folder
    argv = ["generate", "--load", str(folder), "--prompt", "The list of the", "--greedy", "--tokens-to-generate", "8"]
    assert main(argv) == 0
    expected = capsys.readouterr().out
    done = subprocess.run([sys.executable, "-m", "gptrain", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == expected
    assert [line for line in done.stderr.splitlines() if "gptrain generate: done in" in line], done.stderr
    cut = subprocess.run(f"{sys.executable} -m gptrain {' '.join(argv[:4])} 'The list' --greedy | head -c 1",
                         shell=True, capture_output=True, text=True, timeout=300)
    assert cut.stdout == "T" and "Traceback" not in cut.stderr, cut.stderr


def test_megatron_folder(tmp_path):
    from test_megatron_import import _layout_checkpoint, legacy_rank_files

    model = GPT(tiny_cfg())
    model.init_weights(5)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    _layout_checkpoint(tmp_path / "meg", legacy_rank_files(ref, 3.0, False, tp=1, pp=1), iteration=7)
    loaded = load_for_inference(tmp_path / "meg")
    assert loaded.kind == "megatron"
    tokens = torch.randint(0, 50257, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.logits(tokens), model.logits(tokens))


def test_gptrain_checkpoint(tmp_path, capsys):
    from gptrain.checkpoint_kind import TRACKER
    from gptrain.train.checkpoint import save_checkpoint

    model = GPT(tiny_cfg())
    model.init_weights(9)
    params = dict(model.named_parameters())
    state = {"config": {"model": dataclasses.asdict(model.cfg), "data": {"vocab_file": None}}}
    save_checkpoint(tmp_path / "ck", 3, params, torch.optim.AdamW(params.values()), state, model.cfg.vocab_size)
    loaded = load_for_inference(tmp_path / "ck")
    assert loaded.kind == "gptrain"
    tokens = torch.randint(0, 50257, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.logits(tokens), model.logits(tokens))
    # a tracker naming a missing iteration, then no tracker: the complete one is read, as training does
    for tracker in ("5", None):
        (tmp_path / "ck" / TRACKER).unlink(missing_ok=True)
        if tracker:
            (tmp_path / "ck" / TRACKER).write_text(tracker)
        loaded = load_for_inference(tmp_path / "ck")
        with torch.no_grad():
            torch.testing.assert_close(loaded.model.logits(tokens), model.logits(tokens))
        warned = capsys.readouterr().err.strip().splitlines()
        assert len(warned) == 1 and warned[0].startswith("WARNING: ") and warned[0].endswith(
            "loading the newest complete checkpoint, iter_0000003, instead"), warned


def test_bad_load_is_one_line(tmp_path, capsys):
    assert main(["generate", "--load", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such checkpoint" in err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--load", str(tmp_path / "empty"), "--prompt", "x"]) == 2
    assert "neither a gptrain/Megatron checkpoint" in capsys.readouterr().err
