"""A Hugging Face GPT-2 folder is read by one reader (interop/hf.py) on every path (convert, --load,
generate and serve): its config.json checked key by key, the weights against the config (every tensor
used, every parameter found), and a sharded index naming only files inside the folder (issue 33,
defect 7)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gptrain.inference.load import load_for_inference
from gptrain.interop.hf import hf_config_dict, load_hf_folder, to_hf_state_dict
from gptrain.model.gpt import GPT
from tiny import tiny_config

CFG = tiny_config(num_layers=3, seq_length=16, max_position_embeddings=16)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    model = GPT(CFG)
    model.init_weights(0)
    out = to_hf_state_dict(model)
    out.pop("lm_head.weight")  # tied: saved once, as transformers does
    return out


def _folder(root: Path, weights: dict, config: dict | str | None = None, **edits) -> Path:
    root.mkdir(parents=True)
    save_file(weights, root / "model.safetensors")
    if config is None:
        config = {**hf_config_dict(CFG, 50256), **edits}
    (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return root


def _both_refuse(folder: Path, *fragments: str) -> str:
    """convert's reader and generate/serve's loader give the same one-line error."""
    messages = []
    for load in (load_hf_folder, load_for_inference):
        with pytest.raises(ValueError) as err:
            load(folder)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "\n" not in messages[0]
    for fragment in fragments:
        assert fragment in messages[0]
    return messages[0]


def test_a_good_folder_loads_the_same_on_every_path(tmp_path, weights):
    folder = _folder(tmp_path / "ok", weights)
    a, b = load_hf_folder(folder), load_for_inference(folder).model
    assert a.cfg.num_layers == 3
    assert all(torch.equal(p, b.get_parameter(k)) for k, p in a.named_parameters())


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tmp_path, weights):
    folder = _folder(tmp_path / "fewer", weights, n_layer=2)
    _both_refuse(folder, f"{folder}: the weights do not match config.json",
                           "config.json says n_layer 2, the weights hold 3 layers",
                           "not used transformer.h.2.attn.c_attn.bias")


def test_missing_and_misshapen_tensors_are_named(tmp_path, weights):
    partial = {k: v for k, v in weights.items() if k != "transformer.h.1.ln_2.bias"}
    _both_refuse(_folder(tmp_path / "missing", partial), "missing transformer.h.1.ln_2.bias")
    bigger = {**weights, "transformer.wpe.weight": torch.zeros(32, 32)}
    _both_refuse(_folder(tmp_path / "shape", bigger), "other shapes: transformer.wpe.weight [32, 32] "
                                                      "(config.json: [16, 32])")


def test_generate_and_serve_keep_converts_refusals(tmp_path, weights):
    _both_refuse(_folder(tmp_path / "scaled", weights, scale_attn_by_inverse_layer_idx=True),
                 "scale_attn_by_inverse_layer_idx is set")
    _both_refuse(_folder(tmp_path / "untied_flag", weights, tie_word_embeddings=False), "tie_word_embeddings is false")
    untied = {**weights, "lm_head.weight": weights["transformer.wte.weight"] + 1}
    _both_refuse(_folder(tmp_path / "untied", untied),
                 "lm_head.weight differs from transformer.wte.weight (an untied output layer)")
    tied = {**weights, "lm_head.weight": weights["transformer.wte.weight"].clone()}  # an equal copy is fine
    load_hf_folder(_folder(tmp_path / "tied", tied))


@pytest.mark.parametrize("config, fragment", [
    ("{not json", "config.json: not valid JSON (Expecting property name enclosed in double quotes at line 1"),
    ("[1, 2]", "config.json: not a JSON object of GPT-2 settings"),
    ({"n_embd": 32, "n_head": 4, "n_positions": 16, "vocab_size": 50257}, "config.json: no 'n_layer'"),
    ({"n_layer": "3", "n_embd": 32, "n_head": 4, "n_positions": 16, "vocab_size": 50257},
     'config.json: n_layer is "3"; expected a positive integer'),
    ({"n_layer": 3, "n_embd": 32, "n_head": 5, "n_positions": 16, "vocab_size": 50257},
     "config.json: --hidden-size 32 is not divisible by --num-attention-heads 5"),
    ({"n_layer": 3, "n_embd": 32, "n_head": 4, "n_positions": 16, "vocab_size": 50257, "layer_norm_epsilon": "x"},
     'config.json: layer_norm_epsilon is "x"; expected a number >= 0'),
])
def test_a_malformed_config_is_one_line_naming_the_file_and_key(tmp_path, weights, config, fragment):
    folder = _folder(tmp_path / "bad", weights, config=config)
    _both_refuse(folder, f"{folder}/{fragment}")


def _sharded(root: Path, weights: dict, names: list[str]) -> Path:
    """``model.safetensors.index.json`` spreading the tensors over ``names`` (written inside ``root``
    when plain, else where they point)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(hf_config_dict(CFG, 50256)))
    keys = sorted(weights)
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: weights[k] for k in keys[i::len(names)]}
        target = (root / name).resolve()
        if not target.exists():
            save_file(part, target)
        weight_map.update({k: name for k in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_a_sharded_folder_loads_and_its_index_names_only_files_inside(tmp_path, weights):
    good = _sharded(tmp_path / "sharded", weights, ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"])
    whole = load_hf_folder(_folder(tmp_path / "whole", weights))
    got = load_for_inference(good).model
    assert all(torch.equal(p, got.get_parameter(k)) for k, p in whole.named_parameters())

    outside = _sharded(tmp_path / "escape", weights, ["../outside.safetensors"])
    assert (tmp_path / "outside.safetensors").is_file()
    _both_refuse(outside, "names shard '../outside.safetensors': a shard must be a plain file name inside")

    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(tmp_path / "outside.safetensors", linked / "model-00001-of-00001.safetensors")
    (linked / "config.json").write_text(json.dumps(hf_config_dict(CFG, 50256)))
    (linked / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in weights}}))
    _both_refuse(linked, "names shard model-00001-of-00001.safetensors, a symbolic link")

    (tmp_path / "escape" / "model.safetensors.index.json").write_text("{\"weight_map\": 3}")
    _both_refuse(outside, "model.safetensors.index.json: no weight_map")


def test_generate_prints_one_line(tmp_path, weights, capsys):
    from gptrain.cli import main

    folder = _folder(tmp_path / "fewer", weights, n_layer=2)
    assert main(["generate", "--load", str(folder), "--prompt", "hi", "--max-new-tokens", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json says n_layer 2, the weights hold 3 layers" in err[0]
