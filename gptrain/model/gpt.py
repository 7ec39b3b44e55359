"""GPT-2 as Megatron-LM builds it, in plain PyTorch: no parallel code and no kernel choices.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention, a 4h GELU MLP,
biases everywhere), a final LayerNorm; ``forward`` returns the hidden states. The output layer is
tied to the word embeddings by parameter identity (``output_layer.weight is
word_embeddings.weight``) and the loss lives in ``model/loss.py``. The vocabulary is padded
(Megatron's rule) for fast matrix shapes; padded rows never receive probability mass.

The fused QKV rows are in Megatron's per-head order ``[heads, 3, head_dim]`` and viewed with the
head count of the local tensor, so a column-parallel shard holds whole heads (q, k and v of each).

The Llama family's parts (Megatron's flags: ``--swiglu``, ``--normalization RMSNorm``,
``--position-embedding-type rope``, ``--group-query-attention``, ``--untie-embeddings-and-output-weights``,
``--disable-bias-linear``) are other modules chosen from the config when the block is built; the
defaults build exactly the GPT-2 modules above. Grouped-query QKV rows are Megatron's
``[groups, heads_per_group + 2, head_dim]`` (each group's queries, then its key and value), which is
``[heads, 3, head_dim]`` when every head is its own group. RoPE rotates split halves
(``rotate_half``, Megatron's default and Hugging Face Llama's), so no permutation between the two.

Fast kernels and parallelism are applied from outside, by swapping modules (``kernels/convert.py``)
and by ``gptrain.parallel``; the model only ever calls ``self.qkv(x)``, ``self.core(qkv)``, ...
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptrain.model.dropout import hashed_dropout


from gptrain.model.config import GPTConfig, padded_vocab_size  # noqa: F401 (re-exported)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d), causal) v through SDPA, on packed qkv (batch, seq, heads, 3, dim);
    returns (batch, seq, heads, dim). ``backends`` (set by the kernel converter) pins SDPA's kernel."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.backends = None

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.permute(3, 0, 2, 1, 4)
        dropout = self.dropout if self.training else 0.0
        if self.backends is None or q.device.type != "cuda":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            with torch.nn.attention.sdpa_kernel(self.backends):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        inner = cfg.num_attention_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * inner, bias=cfg.add_bias_linear or cfg.add_qkv_bias)
        self.core = CoreAttention(cfg.attention_dropout)
        self.proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.add_bias_linear)
        self.recompute_core = False  # selective recompute (parallel/parallelize.py sets it)

    def heads(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as (batch, heads, seq, dim) from the QKV projection's output (the KV cache's view)."""
        b, s = qkv.shape[:2]
        return qkv.view(b, s, qkv.shape[-1] // (3 * self.head_dim), 3, self.head_dim).permute(3, 0, 2, 1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        # the local head count: a tensor-parallel shard holds whole heads; (batch, seq) from qkv, which
        # covers every token of the micro-batch also where x holds a sequence-parallel share
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, qkv.shape[-1] // (3 * self.head_dim), 3, self.head_dim)
        if self.recompute_core and self.training:
            y = checkpoint(self.core, qkv, use_reentrant=False)
        else:
            y = self.core(qkv)
        return self.proj(y.reshape(b, s, -1))


def rotary_cos_sin(positions: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq, dim) of RoPE's angles, in fp32; each frequency twice (split halves)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of t (..., seq, dim) by split halves; the rest pass
    (Megatron's --rotary-percent)."""
    d = cos.shape[-1]
    rot, rest = t[..., :d], t[..., d:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos.to(t.dtype) + torch.cat((-second, first), dim=-1) * sin.to(t.dtype)
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


class GroupedCoreAttention(nn.Module):
    """Causal SDPA of q (batch, heads, seq, dim) over k, v (batch, groups, seq, dim): query head i
    reads K/V group i // (heads / groups). Returns (batch, seq, heads, dim)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.backends = None  # as CoreAttention's

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        gqa = k.shape[1] != q.shape[1]
        if self.backends is None or q.device.type != "cuda":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
        else:
            with torch.nn.attention.sdpa_kernel(self.backends):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
        return y.transpose(1, 2)


class GroupedQueryAttention(nn.Module):
    """Attention with K/V groups and RoPE (or no positions): the QKV rows per group are
    ``[heads_per_group queries, key, value]`` x head_dim, so a row split by groups keeps them whole."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.per_group = cfg.head_dim, cfg.num_attention_heads // cfg.num_query_groups
        self.rotary = (cfg.rotary_dim, float(cfg.rotary_base)) if cfg.position_embedding_type == "rope" else None
        rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, rows, bias=cfg.add_bias_linear or cfg.add_qkv_bias)
        self.core = GroupedCoreAttention(cfg.attention_dropout)
        self.proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.add_bias_linear)
        self.recompute_core = False

    def heads(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (batch, heads, seq, dim), k and v (batch, groups, seq, dim), RoPE applied at ``positions``."""
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, self.per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.per_group].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k, v = qkv[:, :, :, self.per_group].transpose(1, 2), qkv[:, :, :, self.per_group + 1].transpose(1, 2)
        if self.rotary is not None:
            cos, sin = rotary_cos_sin(positions, *self.rotary)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        q, k, v = self.heads(qkv, torch.arange(s, device=qkv.device))
        if self.recompute_core and self.training:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return self.proj(y.reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh GELU: Megatron's fused bias-GELU and Hugging Face GPT-2's "gelu_new"
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLUMLP(nn.Module):
    """fc2(silu(gate(x)) * up(x)) (Megatron's --swiglu; its linear_fc1 is [gate; up]). Two input
    layers rather than one of twice the rows, so a row split keeps gate and up rows paired."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.gate(x)) * self.up(x))


class ZeroCenteredLayerNorm(nn.LayerNorm):
    """Megatron's --apply-layernorm-1p: the weight is stored centred on zero and the norm scales by 1 + it, in
    fp32 (1 + w in bf16 would round away a small w: what zero-centring is for)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float() + 1, bias, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """RMSNorm with --apply-layernorm-1p's zero-centred weight (Megatron's zero_centered_gamma), scaled in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float() + 1, self.eps).to(x.dtype)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.normalization == "RMSNorm":
        return (ZeroCenteredRMSNorm if cfg.apply_layernorm_1p else nn.RMSNorm)(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return (ZeroCenteredLayerNorm if cfg.apply_layernorm_1p else nn.LayerNorm)(cfg.hidden_size, eps=cfg.layernorm_epsilon)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        grouped = cfg.num_query_groups != cfg.num_attention_heads or cfg.position_embedding_type == "rope"
        self.ln1 = make_norm(cfg)
        self.attn = GroupedQueryAttention(cfg) if grouped else CausalSelfAttention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = SwiGLUMLP(cfg) if cfg.swiglu else MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout
        self.layer_number = 0  # set by GPT: which dropout site this is
        # (shard, shards) of the sequence this rank's residual stream holds, with tensor parallelism
        # (hashed dropout, the same mask on every tensor-parallel rank); None: F.dropout
        self.dropout_shard: tuple[int, int] | None = None

    def _dropout(self, y: torch.Tensor, step: torch.Tensor | None, site: int) -> torch.Tensor:
        if self.dropout_shard is None or step is None or not self.training:
            return F.dropout(y, self.hidden_dropout, self.training)
        return hashed_dropout(y, self.hidden_dropout, step, 2 * self.layer_number + site, *self.dropout_shard)

    def forward(self, x: torch.Tensor, dropout_step: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self._dropout(self.attn(self.ln1(x)), dropout_step, 0)
        return x + self._dropout(self.mlp(self.ln2(x)), dropout_step, 1)


class OutputLayer(nn.Module):
    """The output layer; its weight is the word embeddings' (tied by identity in ``GPT``).
    Called, it gives logits over the real vocabulary (inference); training takes ``weight`` into
    the loss, which never forms the logits this way."""

    def __init__(self, vocab_size: int, weight: nn.Parameter):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight[: self.vocab_size])


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(rows, dim)``; on the meta device without its default init, whose ``normal_``
    runs there through a decomposition that imports torch._dynamo (a second of every inference load)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = _embedding(cfg.padded_vocab_size, cfg.hidden_size)
        # RoPE (in attention) or no positions: no table
        self.position_embeddings = (_embedding(cfg.max_position_embeddings, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned_absolute" else None)
        # keyed by index so names stay stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        for i, block in self.layers.items():
            block.layer_number = int(i)
        # tensor parallelism: the hashed dropout's step counter (train/loop.py sets it each step, the
        # forward advances it), so every rank draws the same masks outside tensor-parallel regions
        self.register_buffer("dropout_step", torch.zeros((), dtype=torch.int64), persistent=False)
        self.hashed_dropout = False
        self.final_layernorm = make_norm(cfg)
        untied = cfg.untie_embeddings_and_output_weights
        self.output_layer = OutputLayer(cfg.vocab_size, nn.Parameter(torch.empty_like(self.word_embeddings.weight))
                                        if untied else self.word_embeddings.weight)
        self.recompute_blocks = False  # full recompute (parallel/parallelize.py sets it)
        # sequence parallelism's entry after the embeddings and exit after the final LayerNorm
        # (parallel/tensor_parallel.py swaps them in; identities otherwise)
        self.scatter_tokens, self.gather_tokens = nn.Identity(), nn.Identity()
        # pipeline stages (Megatron's names): the first embeds, the last ends with the final LayerNorm
        self.pre_process = self.post_process = True

    def keep_stage(self, layer_ids: list[int], pre_process: bool, post_process: bool) -> None:
        """Drop what a pipeline rank does not hold (on the meta model): the other layers; the
        position embeddings unless first; the final LayerNorm unless last. The last rank keeps its
        own word embeddings as the tied output layer's weight (Megatron's embedding group keeps
        the two copies equal); an untied output layer needs none."""
        for name in [n for n in self.layers if int(n) not in layer_ids]:
            del self.layers[name]
        self.pre_process, self.post_process = pre_process, post_process
        if not pre_process:
            self.position_embeddings = None
            if not post_process or self.cfg.untie_embeddings_and_output_weights:
                self.word_embeddings = None
        if not post_process:
            self.final_layernorm = None
            self.output_layer = None

    @classmethod
    def unset(cls, cfg: GPTConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> "GPT":
        """The model on ``device`` (floating tensors in ``dtype``, default as built) with its weights'
        memory unset, for a strict load that writes every one of them: PyTorch's default init of every
        layer costs seconds at the 345M."""
        with torch.device("meta"):
            model = cls(cfg)

        def empty(t: torch.Tensor) -> torch.Tensor:
            kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
            return torch.empty(t.shape, dtype=kind, device=device)

        # to_empty's empty_like on meta tensors goes through torch's Python refs, which import sympy
        model._apply(empty)
        model.tie_output_layer()
        model.reset_buffers()
        return model

    def tie_output_layer(self) -> None:
        """The output layer's weight is the word embeddings' again where they are tied (``to_empty``
        and a sharding ``to`` make new tensors)."""
        if self.output_layer is not None and not self.cfg.untie_embeddings_and_output_weights:
            self.output_layer.weight = self.word_embeddings.weight

    def reset_buffers(self) -> None:
        """The buffers' starting values (none is saved in a checkpoint): after ``to_empty`` of a model
        built on the meta device, before its weights are loaded or drawn."""
        self.dropout_step.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int, tp_region=None) -> None:
        """Megatron's init: N(0, std) weights, output projections N(0, std / sqrt(2 L)), zero biases.

        Each element is drawn from a counter-based generator keyed by (seed, parameter name, its
        index in the full tensor) (model/init_draw.py), so every process draws only what it holds
        and the weights depend only on the seed, never on the layout: ``tp_region(name, full_shape)``
        gives the part of the full tensor a tensor-parallel shard holds (None: all of it), and an
        FSDP2 shard narrows it further. The word embeddings draw the real vocabulary's rows; the
        padded rows are zero.
        """
        from gptrain.model.init_draw import normal_region, uniform_stream
        from gptrain.parallel.shards import local, local_region

        self.reset_buffers()
        scaled_std = self.cfg.init_method_std / math.sqrt(2.0 * self.cfg.num_layers)
        held = dict(self.named_parameters())
        for name, shape in full_parameter_shapes(self.cfg):
            param = held.get(name)
            if param is None:  # another pipeline stage's
                continue
            region = local_region(param, tuple(shape), tp_region(name, tuple(shape)) if tp_region else None)
            target = local(param)
            if name.endswith("bias"):
                target.zero_()
            elif "layernorm" in name or ".ln" in name:
                target.fill_(0.0 if self.cfg.apply_layernorm_1p else 1.0)  # zero-centred: a scale of 1 either way
            elif name in ("word_embeddings.weight", "output_layer.weight"):  # the latter when untied
                target.zero_()
                rows = region[0]
                real = slice(rows.start, max(rows.start, min(rows.stop, self.cfg.vocab_size)))
                if real.stop > real.start:
                    normal_region(seed, uniform_stream(name), (self.cfg.vocab_size, shape[1]), (real, *region[1:]),
                                  self.cfg.init_method_std, out=target[: real.stop - real.start])
            else:
                std = scaled_std if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else self.cfg.init_method_std
                normal_region(seed, uniform_stream(name), tuple(shape), region, std, out=target)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final LayerNorm, (batch, seq, hidden). A pipeline stage takes
        the previous stage's hidden states instead of tokens unless it is the first, and returns
        them before the final LayerNorm unless it is the last."""
        return self.run_layers(tokens, list(self.layers.values()), self.pre_process, self.post_process)

    def embed(self, tokens: torch.Tensor, dropout_step: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        if dropout_step is not None:  # the embeddings' output is whole on every tensor-parallel rank
            return hashed_dropout(x, self.cfg.hidden_dropout, dropout_step, 2 * self.cfg.num_layers)
        return F.dropout(x, self.cfg.hidden_dropout, self.training)

    def run_layers(self, x: torch.Tensor, blocks: list[nn.Module], embed: bool, final: bool) -> torch.Tensor:
        """Embeddings (if ``embed``), ``blocks`` in order, the final LayerNorm (if ``final``): the
        whole model, or one pipeline chunk of it."""
        step = None
        if self.hashed_dropout and self.training:
            # this forward's value, passed to the blocks so a recomputed block redraws the same masks
            step = self.dropout_step.clone()
            self.dropout_step.add_(1)
        if embed:
            x = self.scatter_tokens(self.embed(x, step))
        for block in blocks:
            if self.recompute_blocks and self.training:
                x = checkpoint(block, x, step, use_reentrant=False)
            else:
                x = block(x, step)
        return self.gather_tokens(self.final_layernorm(x)) if final else x

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary (inference and tests)."""
        return self.output_layer(self(tokens))


def full_parameter_shapes(cfg: GPTConfig) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every parameter of the whole model, in registration order."""
    with torch.device("meta"):
        return [(n, p.shape) for n, p in GPT(cfg).named_parameters()]
