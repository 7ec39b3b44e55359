"""gptrain convert --to megatron / --from megatron of a Llama-style model (SwiGLU, RMSNorm, rope, grouped-query
attention, untied output layer, no biases): megatron-core's own GPTModel loads the written torch (TP1) and
torch_dist (TP2) checkpoints strictly and gives gptrain's logits; reading them back gives gptrain's weights."""
from __future__ import annotations

import pytest
import torch

from gptrain.cli import main
from gptrain.interop.convert import read_gptrain, write_gptrain
from gptrain.interop.megatron import check_supported, read_megatron_checkpoint
from gptrain.interop.safe_unpickle import load_pickle_safely
from gptrain.model.gpt import GPTConfig
from test_convert_megatron import _megatron_core_logits
from test_llama import LLAMA, _random_model

LAYOUTS = {"torch_tp1": ("torch", 1), "dist_tp2": ("torch_dist", 2), "torch_tp2": ("torch", 2)}
VOCAB = LLAMA["vocab_size"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_to_megatron")
    write_gptrain(_random_model(GPTConfig(**LLAMA)), root / "src", 7, {})
    for name, (fmt, tp) in LAYOUTS.items():
        assert main(["convert", "--to", "megatron", str(root / "src"), str(root / name), "--ckpt-format", fmt,
                     "--tensor-model-parallel-size", str(tp)]) == 0
    return root


def test_args_and_per_rank_fc1_are_megatrons(converted):
    source, _ = read_gptrain(converted / "src")
    folder = converted / "torch_tp2" / "iter_0000007"
    ranks = [load_pickle_safely(folder / f"mp_rank_0{r}" / "model_optim_rng.pt") for r in (0, 1)]
    args = ranks[0]["args"]
    assert (args.swiglu, args.normalization, args.position_embedding_type, args.rotary_base) == (True, "RMSNorm",
                                                                                                 "rope", 500000)
    assert (args.group_query_attention, args.num_query_groups, args.kv_channels) == (True, 2, 16)
    assert (args.untie_embeddings_and_output_weights, args.add_bias_linear, args.ffn_hidden_size) == (True, False, 128)
    gate, up = source.layers["1"].mlp.gate.weight, source.layers["1"].mlp.up.weight
    for r, sd in enumerate(ranks):  # each rank's linear_fc1 is its own [gate_r; up_r]
        fc1 = sd["model"]["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
        qkv = sd["model"]["decoder.layers.1.self_attention.linear_qkv.weight"]  # one whole K/V group per rank
        assert torch.equal(qkv, source.layers["1"].attn.qkv.weight.chunk(2)[r])
        assert sd["model"]["output_layer.weight"].shape == (128, 64)  # untied, vocab-parallel: 256 rows at TP2
        assert not any(k.endswith(".bias") or "position_embeddings" in k for k in sd["model"])


def test_back_to_gptrain_is_bit_identical(converted):
    source, _ = read_gptrain(converted / "src")
    for name in LAYOUTS:
        ckpt = read_megatron_checkpoint(converted / name)
        cfg = ckpt.gpt_config()
        assert (cfg.swiglu, cfg.normalization, cfg.position_embedding_type, cfg.num_query_groups,
                cfg.untie_embeddings_and_output_weights, cfg.add_bias_linear) == (True, "RMSNorm", "rope", 2, True, False)
        assert main(["convert", "--from", "megatron", str(converted / name), str(converted / f"{name}_back")]) == 0
        back, _ = read_gptrain(converted / f"{name}_back")
        for key, p in source.named_parameters():
            q = back.get_parameter(key)
            if key in ("word_embeddings.weight", "output_layer.weight"):
                p, q = p[:VOCAB], q[:VOCAB]
            assert torch.equal(p, q), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch_tp1", "dist_tp2"])
def test_megatron_core_gptmodel_loads_it_with_gptrains_logits(converted, tmp_path, name):
    fmt, tp = LAYOUTS[name]
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    got = _megatron_core_logits(tmp_path, tp, 1, [converted / name / "iter_0000007"], tokens)[0]
    source, _ = read_gptrain(converted / "src")
    with torch.no_grad():
        ours = source.eval().logits(tokens)[..., :VOCAB]
    assert got["missing"] == [] and got["logits"].shape == (2, 32, 128 * tp)
    assert torch.all(got["logits"][..., VOCAB:] == 0)  # the output layer's padding rows are zero
    diff = (got["logits"][..., :VOCAB] - ours).abs().max().item()
    print(f"megatron-core vs gptrain ({name}), max abs logit difference {diff:.2e}")
    assert diff <= 1e-4 * max(1.0, ours.abs().max().item()), diff


@pytest.mark.parametrize("flag", ["rotary_interleaved", "qk_layernorm", "use_rope_scaling"])
def test_what_gptrain_cannot_hold_is_refused(flag):
    args = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "num_attention_heads": 4,
            "group_query_attention": True, "num_query_groups": 2, flag: True}
    with pytest.raises(ValueError, match=f"does not support.*--{flag.replace('_', '-')}"):
        check_supported(args, "ckpt")
    check_supported({**args, flag: False}, "ckpt")
    check_supported({**args, flag: False, "apply_layernorm_1p": True}, "ckpt")  # zero-centred norms: held (1p)


def test_load_into_a_run_checks_the_family_flags(converted):
    """--load of a Megatron Llama-style checkpoint: the run's flags must match what its args imply (one line
    naming the flag), and matching flags load every weight."""
    import dataclasses

    from gptrain.config import parse_megatron_args
    from gptrain.model.gpt import GPT
    from gptrain.train.megatron_load import load_megatron
    from test_llama import LLAMA_FLAGS

    base = ["--mock-data", "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32"]
    def parsed(flags):  # the vocabulary as the run's tokenizer sets it (NullTokenizer: --vocab-size + 1)
        cfg = parse_megatron_args(base + flags)[0]
        cfg.model = dataclasses.replace(cfg.model, vocab_size=VOCAB)
        return cfg

    source, _ = read_gptrain(converted / "src")
    cfg = parsed(LLAMA_FLAGS)
    model = GPT(cfg.model)
    state = load_megatron(converted / "torch_tp1", dict(model.named_parameters()), cfg)
    assert state["iteration"] == 7
    assert all(torch.equal(p, source.get_parameter(k)) for k, p in model.named_parameters())
    wrong = parsed([f if f != "2" else "4" for f in LLAMA_FLAGS])  # 4 K/V groups, not 2
    with pytest.raises(ValueError, match=r"^--num-query-groups: the run has num_query_groups 4, the checkpoint's args "
                                         r"\(.*\) implies 2$"):
        load_megatron(converted / "torch_tp1", dict(GPT(wrong.model).named_parameters()), wrong)
