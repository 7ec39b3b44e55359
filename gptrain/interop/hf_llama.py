"""Weights between gptrain's Llama-style GPT (``--swiglu --normalization RMSNorm
--position-embedding-type rope``, any K/V groups, tied or untied) and transformers' ``LlamaForCausalLM``.

gptrain's fused QKV rows are Megatron's ``[groups, heads_per_group + 2, head_dim]`` (each group's
queries, then its key, then its value); Llama keeps ``q_proj`` (heads in group order), ``k_proj`` and
``v_proj`` apart, so the rows are split and joined, never permuted within a head: both rotate split
halves (``rotate_half``), Megatron's default RoPE layout. (Meta's original checkpoints rotate
interleaved pairs; transformers' own converter permutes those into split halves, which is what
these files hold.) SwiGLU's ``gate`` and ``up`` are Llama's ``gate_proj`` and ``up_proj``; the
vocabulary is unpadded in the files (padded rows dropped on export, zero on import).
"""
from __future__ import annotations

import json

import torch

from gptrain.model.gpt import GPT, GPTConfig

_NORMS = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight"}
_MLP = {"gate": "gate_proj", "up": "up_proj", "fc2": "down_proj"}
SKIPPED = (".rotary_emb.inv_freq",)  # a buffer older Llama exports carry


def llama_problems(cfg: GPTConfig) -> list[str]:
    """What of ``cfg`` a LlamaForCausalLM cannot hold (empty: it can)."""
    problems = []
    if not cfg.swiglu:
        problems.append("Llama's MLP is SwiGLU (--swiglu)")
    if cfg.normalization != "RMSNorm":
        problems.append("Llama normalizes with RMSNorm (--normalization RMSNorm)")
    if cfg.apply_layernorm_1p:
        problems.append("Llama's norm weights are not zero-centred (--apply-layernorm-1p's conversion is not built)")
    if cfg.position_embedding_type != "rope":
        problems.append("Llama's positions are RoPE (--position-embedding-type rope)")
    elif cfg.rotary_percent != 1.0:
        problems.append(f"Llama rotates every channel of a head (--rotary-percent {cfg.rotary_percent})")
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        problems.append("Llama's attention_bias covers q, k, v and o together (--add-qkv-bias alone)")
    return problems


def llama_config_dict(cfg: GPTConfig, bos: int, eos: int) -> dict:
    """``config.json`` of transformers' LlamaForCausalLM for ``cfg`` (written without transformers)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
            "rope_theta": float(cfg.rotary_base),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
            "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
            "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}


def gpt_config_from_llama(hf: dict, where: str, setting) -> GPTConfig:
    """The GPTConfig of a LlamaForCausalLM ``config.json``; ``setting(hf, key, kind, where, default)``
    reads and type-checks one key (interop/hf.py's)."""
    if setting(hf, "hidden_act", "text", where, "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r}; gptrain's --swiglu gates with silu")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{where}: RoPE scaling {json.dumps(rope)}; gptrain implements plain RoPE (rope_type default)")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor is set; Llama's attention rotates whole heads")
    attention_bias = setting(hf, "attention_bias", "flag", where, False)
    if setting(hf, "mlp_bias", "flag", where, False) != attention_bias:
        raise ValueError(f"{where}: attention_bias {attention_bias} but mlp_bias {hf.get('mlp_bias')}; gptrain's "
                         "--disable-bias-linear takes the biases of every linear layer together")
    hidden, heads = setting(hf, "hidden_size", "count", where), setting(hf, "num_attention_heads", "count", where)
    groups = setting(hf, "num_key_value_heads", "count", where, heads)
    positions = setting(hf, "max_position_embeddings", "count", where, 2048)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return GPTConfig(
        num_layers=setting(hf, "num_hidden_layers", "count", where), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=setting(hf, "intermediate_size", "count", where), seq_length=positions,
        max_position_embeddings=positions, vocab_size=setting(hf, "vocab_size", "count", where),
        layernorm_epsilon=setting(hf, "rms_norm_eps", "number", where, 1e-6),
        init_method_std=setting(hf, "initializer_range", "number", where, 0.02),
        hidden_dropout=0.0, attention_dropout=setting(hf, "attention_dropout", "number", where, 0.0),
        swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
        untie_embeddings_and_output_weights=not setting(hf, "tie_word_embeddings", "flag", where, False),
        add_bias_linear=attention_bias, kv_channels=setting(hf, "head_dim", "count", where, hidden // heads))


def expected_llama_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s LlamaForCausalLM as its safetensors hold it (a tied lm_head aside)."""
    h, f, v, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    if cfg.add_bias_linear:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                      "self_attn.o_proj.bias": (h,), "mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,),
                      "mlp.down_proj.bias": (h,)})
    for i in range(cfg.num_layers):
        out.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return out


def _split_qkv(t: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, ...]:
    per_group = cfg.num_attention_heads // cfg.num_query_groups
    grouped = t.reshape(cfg.num_query_groups, per_group + 2, cfg.kv_channels, *t.shape[1:])
    q = grouped[:, :per_group].reshape(-1, *t.shape[1:])
    return q, grouped[:, per_group].reshape(-1, *t.shape[1:]), grouped[:, per_group + 1].reshape(-1, *t.shape[1:])


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    g, d = cfg.num_query_groups, cfg.kv_channels
    rest = q.shape[1:]
    parts = (q.reshape(g, -1, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def to_llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The LlamaForCausalLM tensors of a Llama-style gptrain GPT (``lm_head.weight`` also when tied)."""
    cfg, sd = model.cfg, model.state_dict()
    problems = llama_problems(cfg)
    if problems:
        raise ValueError("this model is not Llama-shaped: " + "; ".join(problems))
    v = cfg.vocab_size
    out = {"model.embed_tokens.weight": sd["word_embeddings.weight"][:v].clone(),
           "model.norm.weight": sd["final_layernorm.weight"].clone(),
           "lm_head.weight": sd["output_layer.weight"][:v].clone()}
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _NORMS.items():
            out[theirs + b] = sd[ours + a].clone()
        for kind in kinds:
            q, k, val = _split_qkv(sd[f"{ours}attn.qkv.{kind}"], cfg)
            out.update({f"{theirs}self_attn.q_proj.{kind}": q.clone(), f"{theirs}self_attn.k_proj.{kind}": k.clone(),
                        f"{theirs}self_attn.v_proj.{kind}": val.clone(),
                        f"{theirs}self_attn.o_proj.{kind}": sd[f"{ours}attn.proj.{kind}"].clone()})
            for a, b in _MLP.items():
                out[f"{theirs}mlp.{b}.{kind}"] = sd[f"{ours}mlp.{a}.{kind}"].clone()
    return out


def from_llama_state_dict(hf_sd: dict[str, torch.Tensor], cfg: GPTConfig, where: str = "the weights") -> GPT:
    """A gptrain GPT holding a LlamaForCausalLM's tensors (names checked by interop/hf.check_hf_weights);
    with tie_word_embeddings a present lm_head must equal the embeddings."""
    sd = {k: val for k, val in hf_sd.items() if not k.endswith(SKIPPED)}
    embed = sd["model.embed_tokens.weight"]
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in sd \
            and not torch.equal(sd["lm_head.weight"].to(embed.dtype), embed):
        raise ValueError(f"{where}: lm_head.weight differs from model.embed_tokens.weight but config.json says "
                         "tie_word_embeddings true")

    def padded(t: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(cfg.padded_vocab_size, cfg.hidden_size, dtype=t.dtype)
        full[: cfg.vocab_size] = t
        return full

    word = padded(embed)
    ours = {"word_embeddings.weight": word, "final_layernorm.weight": sd["model.norm.weight"],
            "output_layer.weight": padded(sd["lm_head.weight"]) if cfg.untie_embeddings_and_output_weights else word}
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    for i in range(cfg.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _NORMS.items():
            ours[mine + a] = sd[theirs + b]
        for kind in kinds:
            ours[f"{mine}attn.qkv.{kind}"] = _join_qkv(*(sd[f"{theirs}self_attn.{p}_proj.{kind}"] for p in "qkv"),
                                                       cfg)
            ours[f"{mine}attn.proj.{kind}"] = sd[f"{theirs}self_attn.o_proj.{kind}"]
            for a, b in _MLP.items():
                ours[f"{mine}mlp.{a}.{kind}"] = sd[f"{theirs}mlp.{b}.{kind}"]
    model = GPT(cfg)
    model.load_state_dict(ours, strict=True)
    return model
