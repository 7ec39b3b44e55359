"""The Llama-family flags (Megatron's names and defaults): SwiGLU, RMSNorm, RoPE, grouped-query
attention, --kv-channels, no biases, an untied output layer; scored against transformers'
LlamaForCausalLM both ways, trained, converted, generated, and the refusals."""
from __future__ import annotations

import json

import pytest
import torch

from gptrain.config import parse_megatron_args
from gptrain.interop.hf import hf_config_dict, load_hf_folder, to_hf_state_dict
from gptrain.model.gpt import GPT, GPTConfig
from tiny import TINY_FLAGS

transformers = pytest.importorskip("transformers")

# the tiny Llama: 2 layers, hidden 64, 4 heads, 2 K/V groups, SwiGLU, RMSNorm, RoPE, untied, no biases
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100,
             attention_dropout=0.0, hidden_dropout=0.0, swiglu=True, normalization="RMSNorm",
             position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False, rotary_base=500000,
             layernorm_epsilon=1e-6)
LLAMA_FLAGS = ("--swiglu --normalization RMSNorm --norm-epsilon 1e-6 --use-rotary-position-embeddings --rotary-base "
               "500000 --group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
               "--disable-bias-linear").split()


def _random_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    """Weights far from init (std 0.3, norms around 1) so every layout mistake moves the log-probs."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "ln" in name or "layernorm" in name else 0.3 * torch.randn_like(p))
    return model.eval()


def _text(cfg: GPTConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1))


def _log_probs(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    return logits[..., :vocab].float().log_softmax(-1)


def _write_folder(model: GPT, folder) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    weights = to_hf_state_dict(model)
    if not model.cfg.untie_embeddings_and_output_weights:
        weights.pop("lm_head.weight")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config_dict(model.cfg, 0)))


@pytest.mark.parametrize("extra", [{}, dict(add_bias_linear=True), dict(kv_channels=8, rotary_base=10000),
                                   dict(untie_embeddings_and_output_weights=False, group_query_attention=False,
                                        num_query_groups=None)],
                         ids=["issue", "biases", "kv-channels", "tied-mha"])
def test_exported_model_scores_text_as_transformers_llama(tmp_path, extra):
    cfg = GPTConfig(**{**LLAMA, **extra})
    model = _random_model(cfg)
    _write_folder(model, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                       torch_dtype=torch.float32).eval()
    tokens = _text(cfg)
    with torch.no_grad():
        ours, theirs = _log_probs(model.logits(tokens), cfg.vocab_size), _log_probs(hf(tokens).logits, cfg.vocab_size)
    assert (ours - theirs).abs().max() < 1e-4
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_transformers_llama_imports_and_scores_as_transformers(tmp_path):
    """A LlamaForCausalLM of transformers' own making (its init, GQA, untied, head_dim apart) read by gptrain."""
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                                      max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = load_hf_folder(tmp_path / "hf", inference=True).eval()
    cfg = model.cfg
    assert (cfg.swiglu, cfg.normalization, cfg.num_query_groups, cfg.untie_embeddings_and_output_weights) == \
        (True, "RMSNorm", 2, True)
    tokens = _text(cfg)[:, :40]
    with torch.no_grad():
        ours, theirs = _log_probs(model.logits(tokens), 100), _log_probs(hf(tokens).logits, 100)
    assert (ours - theirs).abs().max() < 1e-4


def test_kv_cache_decoding_equals_the_full_forward():
    from gptrain.inference.kv_cache import KVCache, forward_cached

    model = _random_model(GPTConfig(**LLAMA))
    tokens = _text(model.cfg)[:, :12]
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model, 2, 16)
        assert cache.k.shape[2] == 2  # the K/V groups, not the heads
        parts = [forward_cached(model, tokens[:, :5], 0, cache)]
        parts += [forward_cached(model, tokens[:, t:t + 1], t, cache) for t in range(5, 12)]
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("llama", [True, False])
def test_graph_step_generates_as_generate(llama, device):
    """The static-shape decode step (the CUDA-graph one on a GPU; eager here) gives generate's tokens and
    log-probabilities, greedy and seeded, for prompts of different lengths, and again on a reused cache."""
    from gptrain.inference.generate import SamplingParams, generate
    from gptrain.inference.graph_step import graph_step_generate

    cfg = GPTConfig(**LLAMA) if llama else GPTConfig(**{k: LLAMA[k] for k in ("num_layers", "hidden_size",
                    "num_attention_heads", "seq_length", "vocab_size", "attention_dropout", "hidden_dropout")})
    model = _random_model(cfg).to(device)
    prompts = [[5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(max_new_tokens=20, temperature=0.0),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)]
    want = generate(model, prompts, params, logprobs=True)
    for _ in range(2):  # on a GPU: the graphs captured, then replayed on the reused cache
        got = graph_step_generate(model, prompts, params, logprobs=True)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        assert all(max(abs(a - b) for a, b in zip(g.logprobs[1:], w.logprobs[1:])) < 1e-4 for g, w in zip(got, want))


def test_megatron_defaults_and_parameter_formula():
    def parse(*extra):
        return parse_megatron_args(["--mock-data", "--train-iters", "1", *TINY_FLAGS, *extra])[0].model
    # Megatron's SwiGLU width: int(4 h 2/3 / 64) x 64; --group-query-attention alone: one K/V group
    assert parse("--hidden-size", "1024", "--num-attention-heads", "16", "--swiglu").ffn_hidden_size == 2688
    assert parse("--group-query-attention").num_query_groups == 1
    assert parse().num_query_groups == 4 and parse().kv_channels == 8 and parse().gpt2_layout
    cfg = parse(*LLAMA_FLAGS)
    assert (cfg.swiglu, cfg.normalization, cfg.layernorm_epsilon, cfg.position_embedding_type, cfg.rotary_base,
            cfg.num_query_groups, cfg.untie_embeddings_and_output_weights, cfg.add_bias_linear) == \
        (True, "RMSNorm", 1e-6, "rope", 500000, 2, True, False)
    assert parse("--position-embedding-type", "none").position_embedding_type == "none"
    for config in (cfg, GPTConfig(**{**LLAMA, "add_bias_linear": False, "add_qkv_bias": True}),
                   GPTConfig(**{**LLAMA, "position_embedding_type": "none", "rotary_percent": 0.5}),
                   GPTConfig(**{**LLAMA, "normalization": "LayerNorm", "swiglu": False, "kv_channels": 24})):
        with torch.device("meta"):
            held = sum(p.numel() for p in GPT(config).parameters())
        assert held == config.num_parameters()
    # FLOPs: 6 x (layers' weights + the output layer) + 12 L s (heads x kv_channels)
    c = GPTConfig(**{**LLAMA, "kv_channels": 8})
    layers = c.num_parameters() - 2 * c.padded_vocab_size * 64
    assert c.flops_per_token() == 6 * (layers + c.padded_vocab_size * 64) + 12 * 2 * 4 * 8 * 32


def test_rotary_percent_rotates_only_the_first_channels():
    from gptrain.model.gpt import apply_rotary, rotary_cos_sin

    t = torch.randn(1, 2, 5, 16)
    cos, sin = rotary_cos_sin(torch.arange(5), 8, 10000.0)
    out = apply_rotary(t, cos, sin)
    assert torch.equal(out[..., 8:], t[..., 8:]) and torch.allclose(out[:, :, 0], t[:, :, 0])  # position 0: identity
    assert not torch.allclose(out[:, :, 1:, :8], t[:, :, 1:, :8])


def test_refusals_name_the_numbers():
    def refused(match, *flags):
        with pytest.raises(ValueError, match=match):
            parse_megatron_args(["--mock-data", "--train-iters", "1", *TINY_FLAGS, *flags])

    refused("--num-attention-heads 4 is not divisible by --num-query-groups 3", "--group-query-attention",
            "--num-query-groups", "3")
    refused("--num-query-groups 2 takes effect only with --group-query-attention", "--num-query-groups", "2")
    refused("rotates 3 channels of each head: an even number", "--use-rotary-position-embeddings",
            "--rotary-percent", "0.375")
    refused("--rotary-interleaved is a Megatron flag gptrain does not implement", "--rotary-interleaved")
    refused("--qk-layernorm is a Megatron flag gptrain does not implement", "--qk-layernorm")
    refused("hidden-size 32 is not divisible by --num-attention-heads 5", "--num-attention-heads", "5")
    assert parse_megatron_args(["--mock-data", "--train-iters", "1", *TINY_FLAGS, "--num-attention-heads", "5",
                                "--kv-channels", "8"])[0].model.kv_channels == 8  # as Megatron: no divisibility needed
    with pytest.raises(ValueError, match="Llama's positions are RoPE"):
        hf_config_dict(GPTConfig(**{**LLAMA, "position_embedding_type": "learned_absolute"}), 0)
    with pytest.raises(ValueError, match="Llama's MLP is SwiGLU"):
        to_hf_state_dict(GPT(GPTConfig(**{**LLAMA, "swiglu": False})))


@pytest.mark.parametrize("edit, match", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'; gptrain's --swiglu gates with silu"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling .*llama3.*; gptrain implements plain"),
    ({"attention_bias": True}, "attention_bias True but mlp_bias False"),
])
def test_llama_folders_gptrain_cannot_hold_are_refused(tmp_path, edit, match):
    model = _random_model(GPTConfig(**LLAMA))
    _write_folder(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("rope_parameters")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=match):
        load_hf_folder(tmp_path / "hf")


def test_train_convert_load_and_generate(tmp_path):
    """gptrain train (Llama flags) -> convert --to hf (checked against transformers inside) -> --from hf ->
    --load of the HF folder by a run with the same flags (contradicting ones refused) -> generate."""
    from gptrain.inference.generate import SamplingParams, generate
    from gptrain.interop.convert import from_hf, read_gptrain, to_hf
    from gptrain.train.run import train_main

    run = ["--mock-data", *TINY_FLAGS, *LLAMA_FLAGS, "--seq-length", "16", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--lr", "1e-3", "--eval-iters", "0", "--device", "cpu"]
    lines = []
    assert train_main(run + ["--train-iters", "3", "--save", str(tmp_path / "ck")], log=lines.append).exit_code == 0
    assert any("number of parameters" in line for line in lines)
    notes = []
    assert to_hf(tmp_path / "ck", tmp_path / "hf", log=notes.append) < 1e-4
    assert "LlamaForCausalLM" in notes[0]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == 2
    assert from_hf(tmp_path / "hf", tmp_path / "back", log=notes.append) < 1e-4
    from gptrain.interop.megatron_write import to_megatron

    assert to_megatron(tmp_path / "ck", tmp_path / "meg", log=notes.append) == 0.0  # read back bit for bit
    back, _ = read_gptrain(tmp_path / "back")
    assert back.cfg.untie_embeddings_and_output_weights and back.cfg.num_query_groups == 2
    lines = []
    loaded = train_main(run + ["--train-iters", "1", "--load", str(tmp_path / "hf")], log=lines.append)
    assert loaded.exit_code == 0 and any("loaded Hugging Face" in line for line in lines)
    from gptrain.train.megatron_load import load_hf

    other = parse_megatron_args(run + ["--train-iters", "1", "--num-query-groups", "4"])[0]
    with pytest.raises(ValueError, match="--num-query-groups: the run has num_query_groups 4, .*implies 2"):
        load_hf(tmp_path / "hf", {}, other)
    out = generate(back.eval(), [[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))
    with torch.no_grad():  # greedy through the KV cache = greedy through the full forward
        tokens = torch.tensor([[1, 2, 3]])
        for _ in range(4):
            tokens = torch.cat([tokens, back.logits(tokens)[:, -1:].argmax(-1)], 1)
    assert out[0].tokens == tokens[0].tolist()


@pytest.mark.slow
def test_tensor_parallel_generation_equals_one_process(tmp_path):
    """gptrain generate of a trained Llama-style checkpoint at TP2 (two gloo ranks: K/V groups, SwiGLU's gate
    and up and the untied output layer split, the graph step's code path) prints one process's greedy text."""
    import subprocess
    import sys

    from gptrain.train.run import train_main

    run = ["--mock-data", *TINY_FLAGS, *LLAMA_FLAGS, "--seq-length", "16", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--lr", "1e-2", "--eval-iters", "0", "--device", "cpu"]
    assert train_main(run + ["--train-iters", "3", "--save", str(tmp_path / "ck")], log=lambda s: None).exit_code == 0
    argv = ["generate", "--load", str(tmp_path / "ck"), "--device", "cpu", "--prompt", "The meaning of life is",
            "--greedy", "--tokens-to-generate", "8"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "gptrain", *argv], capture_output=True, text=True, timeout=120, env=env)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "gptrain", *argv, "--tensor-model-parallel-size", "2"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert two.stdout == one.stdout and one.stdout.startswith("The meaning of life is")


@pytest.fixture(scope="module")
def one_process_llama(tmp_path_factory):
    """The flags, losses and checkpoint of the one-process run every layout is held to (run once)."""
    from distributed import TINY, losses, single

    run = TINY + LLAMA_FLAGS + ["--train-iters", "4"]
    folder = tmp_path_factory.mktemp("llama") / "one"
    return run, losses(single(run + ["--save", str(folder)])), folder


@pytest.mark.slow
@pytest.mark.parametrize("nproc, flags", [(2, ["--tensor-model-parallel-size", "2"]),
                                          (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                          (2, []), (2, ["--zero-stage", "3"]), (2, ["--pipeline-model-parallel-size", "2"])],
                         ids=["tp2", "tp2+sp", "dp2", "dp2-zero3", "pp2"])
def test_llama_layouts_equal_one_process(nproc, flags, tmp_path, one_process_llama):
    """TP shards query heads and K/V groups (whole groups per rank), SwiGLU's gate and up by rows, the
    untied output layer by vocabulary rows; PP keeps the untied output layer on the last stage only (no
    embedding group); the same losses and saved weights as one process."""
    from distributed import losses, torchrun
    from gptrain.train.checkpoint import load_checkpoint

    run, reference, one = one_process_llama
    got = losses(torchrun(nproc, run + flags + ["--save", str(tmp_path / "many")]))
    for it, loss in reference.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    cfg = parse_megatron_args(run, world_size=1)[0].model
    weights = []
    for folder in (one, tmp_path / "many"):
        model = GPT(cfg)
        load_checkpoint(folder, dict(model.named_parameters()), None, cfg.vocab_size)
        weights.append(dict(model.named_parameters()))
    for name, ref in weights[0].items():
        # Adam turns the rounding of near-zero gradients into differences of about 2e-5 (as at GPT-2)
        torch.testing.assert_close(weights[1][name], ref, rtol=1e-5, atol=5e-5, msg=name)


def test_parameters_per_tensor_parallel_rank_follow_the_formula():
    """Every rank holds 1/tp of each matrix (QKV by whole groups, gate and up by rows, the untied output
    layer by vocabulary rows) and the RMSNorms whole."""
    from gptrain.parallel.layout import parameter_counts
    from gptrain.train.build import parallel_dims

    cfg = parse_megatron_args(["--mock-data", "--train-iters", "1", *TINY_FLAGS, *LLAMA_FLAGS,
                               "--tensor-model-parallel-size", "2", "--world-size", "2"])[0]
    norms = (2 * cfg.model.num_layers + 1) * cfg.model.hidden_size
    counts = parameter_counts(cfg.model, parallel_dims(cfg, 2))
    assert counts == {(0, 0): norms + (cfg.model.num_parameters() - norms) // 2, (1, 0): counts[(0, 0)]}
    # PP2: the word embeddings on the first stage, the untied output layer on the last, nothing held twice
    cfg = parse_megatron_args(["--mock-data", "--train-iters", "1", *TINY_FLAGS, *LLAMA_FLAGS,
                               "--pipeline-model-parallel-size", "2", "--world-size", "2",
                               "--global-batch-size", "2"])[0]
    per_layer = (cfg.model.num_parameters() - cfg.model.embedding_parameters() - cfg.model.hidden_size) // 2
    table = cfg.model.padded_vocab_size * cfg.model.hidden_size
    assert parameter_counts(cfg.model, parallel_dims(cfg, 2)) == {
        (0, 0): table + per_layer, (0, 1): per_layer + cfg.model.hidden_size + table}


def test_groups_not_divisible_by_tensor_parallel_are_refused():
    with pytest.raises(ValueError, match="--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4: "
                                         "each tensor-parallel rank holds whole K/V groups"):
        parse_megatron_args(["--mock-data", "--train-iters", "1", *TINY_FLAGS, *LLAMA_FLAGS,
                             "--tensor-model-parallel-size", "4", "--world-size", "4"])


def test_megatron_serve_scripts_take_the_llama_flags_from_the_checkpoint():
    from gptrain.megatron_scripts import server_argv

    argv, notes, _ = server_argv(["--load", "c", *LLAMA_FLAGS, "--kv-channels", "16"])
    assert argv == ["--load", "c"]
    assert any("the checkpoint's own values are used for --swiglu, --normalization RMSNorm" in note for note in notes)
