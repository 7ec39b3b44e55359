"""gptrain convert --to megatron: torch_dist and legacy torch checkpoints that megatron-core's own
GPTModel loads (dist_checkpointing.load at TP1, TP2 and PP2 in gloo processes, load_state_dict(strict=True)
of each rank's model_optim_rng.pt) with gptrain's logits, read back by gptrain bit for bit, refusals."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptrain.cli import main
from gptrain.interop.convert import read_gptrain, write_gptrain
from gptrain.interop.megatron import read_megatron_checkpoint
from gptrain.interop.safe_unpickle import load_pickle_safely
from gptrain.model.gpt import GPT
from gptrain.train.safe_dcp import read_metadata_safely
from tiny import tiny_config

HELPER = Path(__file__).with_name("megatron_core_load.py")
VOCAB = 1100  # Megatron pads it to 1152 at TP1 (128) and to 1280 at TP2 (256)
TOLERANCE = 1e-5
LAYOUTS = {"dist_tp1": ("torch_dist", 1, 1), "dist_tp2": ("torch_dist", 2, 1), "dist_tp1_pp2": ("torch_dist", 1, 2),
           "torch_tp1": ("torch", 1, 1), "torch_tp2": ("torch", 2, 1), "torch_tp1_pp2": ("torch", 1, 2),
           "torch_tp2_pp2": ("torch", 2, 2)}


def _random_model(vocab_size=VOCAB) -> GPT:
    torch.manual_seed(0)
    model = GPT(tiny_config(seq_length=32, vocab_size=vocab_size))
    with torch.no_grad():  # every parameter away from its init (LayerNorms and biases included)
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if ".ln" in name or "layernorm" in name else torch.randn_like(p) * 0.1)
        model.word_embeddings.weight[vocab_size:] = 0
    return model


def _convert(src, out, fmt, tp, pp):
    return main(["convert", "--to", "megatron", str(src), str(out), "--ckpt-format", fmt,
                 "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("to_megatron")
    write_gptrain(_random_model(), root / "src", 7, {"consumed_train_samples": 56, "consumed_valid_samples": 8})
    for name, (fmt, tp, pp) in LAYOUTS.items():
        assert _convert(root / "src", root / name, fmt, tp, pp) == 0
    return root


def _megatron_core_logits(tmp_path, tp, pp, folders, tokens):
    torch.save(tokens, tmp_path / "tokens.pt")
    done = subprocess.run([sys.executable, str(HELPER), str(tp), str(pp), str(tmp_path / "tokens.pt"),
                           str(tmp_path / "out.pt"), *map(str, folders)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return torch.load(tmp_path / "out.pt")


def _check_against_gptrain(converted, results, tokens, names, padded_rows):
    source, _ = read_gptrain(converted / "src")
    with torch.no_grad():
        ours = source.eval().logits(tokens)
    diffs = []
    for name, got in zip(names, results):
        assert got["missing"] == [] and got["logits"].shape == (*tokens.shape, padded_rows), name
        assert set(got["unexpected"]) <= {"args", "checkpoint_version", "iteration", "content_metadata",
                                          "num_floating_point_operations_so_far"}, name
        assert torch.all(got["logits"][..., VOCAB:] == 0), name  # Megatron's padding rows are zero
        diff = (got["logits"][..., :VOCAB] - ours).abs().max().item()
        assert diff <= TOLERANCE, (name, diff)
        diffs.append(diff)
    print(f"megatron-core vs gptrain logits, max abs difference: {dict(zip(names, diffs))}")
    return diffs


def _tokens():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


def test_torch_dist_layout_is_megatron_cores(converted):
    root = converted / "dist_tp1"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "7"
    folder = root / "iter_0000007"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((folder / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                  "sharded_backend_version": 1}
    meta = read_metadata_safely(folder, allow_bytes=True).state_dict_metadata
    fixture = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt" / "dev_dist_tp1"
    if fixture.is_dir():  # the same keys as Megatron-LM's own save (rerun state aside: it holds none when idle)
        theirs = read_metadata_safely(fixture / "iter_0000020", allow_bytes=True).state_dict_metadata
        assert set(meta) == set(theirs) - {"rerun_state_machine_state/shard_0_1"}
    assert meta["embedding.word_embeddings.weight"].size == (1152, 32)
    assert meta["decoder.layers.self_attention.linear_qkv.weight"].size == (2, 96, 32)
    assert meta["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].size == (2, 32)
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2" in meta and "common_state/shard_0_1" in meta
    tp2 = read_metadata_safely(converted / "dist_tp2" / "iter_0000007", allow_bytes=True).state_dict_metadata
    assert tp2["embedding.word_embeddings.weight"].size == (1280, 32)  # make_vocab_size_divisible_by x TP
    common = load_pickle_safely(folder / "common.pt")  # gptrain's allow-list reader
    assert common["iteration"] == 7 and common["checkpoint_version"] == 3.0
    args = common["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (2, 32, 4, 128)
    assert (args.padded_vocab_size, args.tokenizer_type, args.vocab_size) == (1152, "NullTokenizer", VOCAB - 1)
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (56, 8)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    with torch.serialization.safe_globals([argparse.Namespace]):  # torch.load(weights_only=True) as Megatron does
        assert torch.load(folder / "common.pt")["args"] == args
    ckpt = read_megatron_checkpoint(root)
    assert ckpt.layout == "megatron-core torch_dist" and ckpt.iteration == 7


def test_torch_layout_per_rank(converted):
    folder = converted / "torch_tp2_pp2" / "iter_0000007"
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                        "mp_rank_01_001"]
    first = load_pickle_safely(folder / "mp_rank_01_000" / "model_optim_rng.pt")
    last = load_pickle_safely(folder / "mp_rank_01_001" / "model_optim_rng.pt")
    assert first["checkpoint_version"] == 3.0 and first["iteration"] == 7
    assert first["model"]["embedding.word_embeddings.weight"].shape == (640, 32)  # 1280 rows over 2 ranks
    assert first["model"]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (48, 32)
    assert first["model"]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 16)
    assert "output_layer.weight" not in first["model"] and "decoder.final_layernorm.weight" not in first["model"]
    assert sorted({k.split(".")[2] for k in last["model"] if k.startswith("decoder.layers.")}) == ["0"]  # stage-local
    assert torch.equal(last["model"]["output_layer.weight"], first["model"]["embedding.word_embeddings.weight"])


def test_torch_dist_tp1_loads_into_megatron_core_gptmodel(converted, tmp_path):
    tokens = _tokens()
    names = ["dist_tp1", "torch_tp1"]
    results = _megatron_core_logits(tmp_path, 1, 1, [converted / n / "iter_0000007" for n in names], tokens)
    meta = read_metadata_safely(converted / "dist_tp1" / "iter_0000007", allow_bytes=True).state_dict_metadata
    assert set(results[0]["keys"]) <= set(meta)  # every key megatron-core's sharded_state_dict asks for
    _check_against_gptrain(converted, results, tokens, names, 1152)


@pytest.mark.slow
def test_tp2_loads_into_megatron_core_gptmodel_in_two_processes(converted, tmp_path):
    tokens = _tokens()
    names = ["dist_tp2", "torch_tp2"]
    results = _megatron_core_logits(tmp_path, 2, 1, [converted / n / "iter_0000007" for n in names], tokens)
    _check_against_gptrain(converted, results, tokens, names, 1280)


@pytest.mark.slow
def test_pp2_stages_load_into_megatron_core_gptmodel(converted, tmp_path):
    """Two pipeline stages, the hidden states sent between them: the last stage's output layer is its
    own copy of the word embeddings (torch: output_layer.weight; torch_dist: the embeddings' key)."""
    tokens = _tokens()
    names = ["dist_tp1_pp2", "torch_tp1_pp2"]
    results = _megatron_core_logits(tmp_path, 1, 2, [converted / n / "iter_0000007" for n in names], tokens)
    _check_against_gptrain(converted, results, tokens, names, 1152)


def test_round_trip_back_to_gptrain_is_bit_identical(converted, capsys):
    source, _ = read_gptrain(converted / "src")
    for name in LAYOUTS:
        back_dir = converted / f"{name}_back"
        assert main(["convert", "--from", "megatron", str(converted / name), str(back_dir)]) == 0, name
        back, state = read_gptrain(back_dir)
        assert state["consumed_train_samples"] == 56 and state["consumed_valid_samples"] == 8
        for key, p in source.named_parameters():
            q = back.get_parameter(key)
            if key == "word_embeddings.weight":
                p, q = p[:VOCAB], q[:VOCAB]
            assert torch.equal(p, q), (name, key)
    assert "max abs difference 0.000e+00" in capsys.readouterr().out


def test_gpt2_vocabulary_is_written_as_gpt2bpetokenizer(tmp_path):
    write_gptrain(_random_model(50257), tmp_path / "src", "release", {})
    assert _convert(tmp_path / "src", tmp_path / "out", "torch_dist", 1, 1) == 0
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "release"
    ckpt = read_megatron_checkpoint(tmp_path / "out")
    assert ckpt.args["tokenizer_type"] == "GPT2BPETokenizer" and Path(ckpt.args["vocab_file"]).is_file()
    assert ckpt.gpt_config().vocab_size == 50257 and ckpt.args["padded_vocab_size"] == 50304
    gone = {"vocab_file": str(tmp_path / "moved.json"), "merge_file": str(tmp_path / "moved.txt")}
    write_gptrain(_random_model(50257), tmp_path / "src2", 3, {}, gone)  # its tokenizer files moved away
    assert _convert(tmp_path / "src2", tmp_path / "out2", "torch", 1, 1) == 0
    args = read_megatron_checkpoint(tmp_path / "out2").args
    assert (args["tokenizer_type"], args["vocab_size"]) == ("NullTokenizer", 50256)


@pytest.mark.parametrize("tp, pp, why", [
    (3, 1, "4 attention heads are not divisible by --tensor-model-parallel-size 3"),
    (1, 3, "2 layers are not divisible by --pipeline-model-parallel-size 3"),
    (0, 1, "both must be at least 1"),
])
def test_layouts_megatron_cannot_split_are_refused(converted, tmp_path, capsys, tp, pp, why):
    out = tmp_path / "out"
    assert _convert(converted / "src", out, "torch_dist", tp, pp) == 2
    err = capsys.readouterr().err
    assert why in err and "nothing was written" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_megatron_flags_without_to_megatron_are_refused(converted, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "--to", "hf", str(converted / "src"), str(tmp_path / "hf"), "--ckpt-format", "torch"])
    assert exit_.value.code == 2 and list(tmp_path.iterdir()) == []


def test_an_existing_output_is_refused(converted, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert _convert(converted / "src", out, "torch", 1, 1) == 2
    assert "exists: give a new folder" in capsys.readouterr().err
    assert list(out.iterdir()) == [] and list(tmp_path.iterdir()) == [out]
