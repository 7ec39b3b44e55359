"""`gptrain bench` on a CPU: progress while it runs, n/a (not nan) for GPU memory, and the ratio
flagged as meaningful only on a GPU."""
from __future__ import annotations

import re

from gptrain.bench import bench_main
from tiny import TINY_FLAGS

TINY = TINY_FLAGS + ("--seq-length 32 --micro-batch-size 2 "
        "--hidden-dropout 0 --attention-dropout 0 --device cpu").split()


def test_bench_on_cpu_reports_progress_and_no_nan(capsys):
    assert bench_main(TINY + ["--warmup", "1", "--iters", "2", "--baseline-no-compile"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    lines = out.splitlines()
    stamped = [line for line in lines if re.match(r"(gptrain|baseline): ", line)]
    # each with the seconds since gptrain's import, rising
    at = [float(re.search(r" \[([\d.]+) s\]$", x).group(1)) for x in stamped]
    assert at == sorted(at) and len(at) == len(stamped)
    progress = [re.sub(r" \[[\d.]+ s\]$", "", x) for x in stamped]
    assert progress[0] == "gptrain: building the model ..."
    assert "gptrain: 1 warm-up iterations (compilation happens here) ..." in progress
    assert any(re.match(r"gptrain: timing 2 iterations \(warm-up took [\d.]+ s\) \.\.\.$", x) for x in progress)
    assert any(re.match(r"baseline: [\d.]+ ms per iteration$", x) for x in progress)
    # progress comes before the table
    assert lines.index(stamped[-1]) < next(i for i, x in enumerate(lines) if x.startswith("| what |"))
    rows = [line for line in lines if line.startswith(("| gptrain (train step)", "| baseline (plain PyTorch, GPT-2 style)"))]
    assert len(rows) == 2 and all(row.endswith("| n/a | n/a | n/a |") for row in rows)
    ratio = next(line for line in lines if line.startswith("gptrain / baseline tokens/s:"))
    assert re.match(r"gptrain / baseline tokens/s: [\d.]+x \(on cpu: .* means something only on a GPU\)$", ratio)


def test_llama_baseline_is_transformers_llama():
    """The Llama-style baseline computes what transformers' LlamaForCausalLM computes (same weights),
    and has the parameter count of gptrain's Llama-style model of the same flags."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from gptrain.bench_models import BaselineLlama, baseline_for
    from gptrain.config import parse_megatron_args

    flags = TINY_FLAGS + ["--seq-length", "32", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                          "rope", "--group-query-attention", "--num-query-groups", "2",
                          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--mock-data", "--train-iters", "1"]
    m = parse_megatron_args(flags)[0].model
    model = baseline_for(m)
    assert isinstance(model, BaselineLlama)
    assert sum(p.numel() for p in model.parameters()) == m.num_parameters()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.padded_vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, max_position_embeddings=m.seq_length, rms_norm_eps=m.layernorm_epsilon,
        rope_theta=float(m.rotary_base), tie_word_embeddings=False, attention_bias=False, mlp_bias=False)).eval()
    sd = hf.state_dict()
    with torch.no_grad():
        model.embed.weight.copy_(sd["model.embed_tokens.weight"])
        for i, blk in enumerate(model.blocks):
            pre = f"model.layers.{i}."
            blk["n1"].weight.copy_(sd[pre + "input_layernorm.weight"])
            blk["n2"].weight.copy_(sd[pre + "post_attention_layernorm.weight"])
            blk["qkv"].weight.copy_(torch.cat([sd[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
            blk["o"].weight.copy_(sd[pre + "self_attn.o_proj.weight"])
            blk["gate_up"].weight.copy_(torch.cat([sd[pre + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]))
            blk["down"].weight.copy_(sd[pre + "mlp.down_proj.weight"])
        model.norm.weight.copy_(sd["model.norm.weight"])
        model.head.weight.copy_(sd["lm_head.weight"])
        tokens = torch.randint(0, m.vocab_size, (2, m.seq_length + 1), generator=torch.Generator().manual_seed(1))
        logits = hf(tokens[:, :-1]).logits
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        assert torch.allclose(model(tokens[:, :-1], tokens[:, 1:]), want, atol=1e-5)
