"""The Llama-family side of Megatron checkpoints (--swiglu, --normalization RMSNorm, rope, grouped-query
attention, --kv-channels, --disable-bias-linear, --add-qkv-bias, an untied output layer), both ways.

What differs from the GPT-2 layers: which tensors exist (no position embeddings with rope, no norm
biases with RMSNorm, no linear biases without --add-bias-linear, ``output_layer.weight`` of its own
when untied) and SwiGLU's ``linear_fc1``, which holds ``[gate; up]`` PER TENSOR-PARALLEL SHARD: the
legacy per-rank files cut it so (their concatenation is ``[g0; u0; g1; u1]``), while torch_dist saves
it at its global shape as ``[gate; up]`` (megatron-core's ``apply_swiglu_sharded_factory``). The
readers merge both to ``[gate; up]`` (rule ``glu``), which becomes gptrain's ``mlp.gate`` / ``mlp.up``.
The fused QKV rows are per K/V group ``[heads_per_group q, k, v]`` in megatron-core as in gptrain, so
a cut on dim 0 gives each rank whole groups.
"""
from __future__ import annotations

import torch

GLU = "glu"


def family(args: dict) -> dict:
    """GPTConfig's Llama-family fields from Megatron's ``args`` (Megatron's defaults where absent)."""
    pos = args.get("position_embedding_type") or "learned_absolute"
    if args.get("use_rotary_position_embeddings"):  # Megatron-LM's older flag
        pos = "rope"
    gqa = bool(args.get("group_query_attention"))
    bias = args.get("add_bias_linear") is not False
    cfg = dict(swiglu=bool(args.get("swiglu")), normalization=args.get("normalization") or "LayerNorm",
               position_embedding_type=pos, group_query_attention=gqa,
               num_query_groups=args.get("num_query_groups") if gqa else None,
               untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights")),
               # QKV has a bias with either; add_qkv_bias matters (and is kept) only without the other
               add_bias_linear=bias, add_qkv_bias=bool(args.get("add_qkv_bias")) and not bias,
               kv_channels=args.get("kv_channels"),
               # the flag's older name, and the TransformerConfig field that replaced it in Megatron-LM's args
               apply_layernorm_1p=bool(args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma")))
    if pos == "rope":
        cfg["rotary_base"] = int(args.get("rotary_base") or 10000)
        cfg["rotary_percent"] = float(args.get("rotary_percent") or 1.0)
    return cfg


def unsupported(args: dict) -> list[str]:
    """The Llama-family options gptrain's GPT cannot hold."""
    problems = []
    f = family(args)
    if f["normalization"] not in ("LayerNorm", "RMSNorm"):
        problems.append(f"--normalization {f['normalization']}")
    if f["position_embedding_type"] not in ("learned_absolute", "rope", "none"):
        problems.append(f"--position-embedding-type {f['position_embedding_type']}")
    for flag in ("rotary_interleaved", "use_rope_scaling", "rotary_seq_len_interpolation_factor", "mrope_section"):
        if args.get(flag):
            problems.append(f"--{flag.replace('_', '-')}")
    heads, groups = args.get("num_attention_heads"), f["num_query_groups"]
    if f["group_query_attention"] and heads and groups and heads % groups:
        problems.append(f"--num-query-groups {groups} (not a divisor of {heads} heads)")
    return problems


def groups_of(args: dict) -> int | None:
    f = family(args)
    heads = args.get("num_attention_heads")
    return (f["num_query_groups"] or 1) if f["group_query_attention"] else heads


def required(args: dict, num_layers: int) -> list[str]:
    """Every gptrain tensor name (fc1 still fused) a checkpoint with these args holds."""
    f = family(args)
    norm = ("weight", "bias") if f["normalization"] == "LayerNorm" else ("weight",)
    bias = f["add_bias_linear"]
    names = ["word_embeddings.weight"] + [f"final_layernorm.{p}" for p in norm]
    if f["position_embedding_type"] == "learned_absolute":
        names.append("position_embeddings.weight")
    if f["untie_embeddings_and_output_weights"]:
        names.append("output_layer.weight")
    layer = [f"ln1.{p}" for p in norm] + [f"ln2.{p}" for p in norm] + ["attn.qkv.weight", "attn.proj.weight",
                                                                         "mlp.fc1.weight", "mlp.fc2.weight"]
    if bias or f["add_qkv_bias"]:
        layer.append("attn.qkv.bias")
    if bias:
        layer += ["attn.proj.bias", "mlp.fc1.bias", "mlp.fc2.bias"]
    return names + [f"layers.{i}.{n}" for i in range(num_layers) for n in layer]


def merge_glu(shards: list[torch.Tensor]) -> torch.Tensor:
    """Per-rank ``[gate_i; up_i]`` shards -> the full ``[gate; up]``."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def shard_glu(value: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The full ``[gate; up]`` -> rank ``rank``'s ``[gate_rank; up_rank]``."""
    gate, up = value.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0).clone()


def split_fc1(state: dict[str, torch.Tensor], num_layers: int) -> None:
    """SwiGLU: each layer's ``mlp.fc1.*`` ([gate; up]) becomes gptrain's ``mlp.gate.*`` and ``mlp.up.*``."""
    for i in range(num_layers):
        for p in ("weight", "bias"):
            fused = state.pop(f"layers.{i}.mlp.fc1.{p}", None)
            if fused is not None:
                gate, up = fused.chunk(2, dim=0)
                state[f"layers.{i}.mlp.gate.{p}"], state[f"layers.{i}.mlp.up.{p}"] = gate.clone(), up.clone()


def writer_args(cfg) -> dict:
    """Megatron's ``args`` entries for these choices (``arguments.py``'s names)."""
    rope = cfg.position_embedding_type == "rope"
    return dict(swiglu=cfg.swiglu, normalization=cfg.normalization,
                position_embedding_type=cfg.position_embedding_type,
                add_position_embedding=cfg.position_embedding_type == "learned_absolute",
                use_rotary_position_embeddings=rope, rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent,
                rotary_interleaved=False, group_query_attention=cfg.group_query_attention,
                num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
                untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
                add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
                bias_swiglu_fusion=cfg.swiglu, apply_layernorm_1p=cfg.apply_layernorm_1p,
                layernorm_zero_centered_gamma=cfg.apply_layernorm_1p)
