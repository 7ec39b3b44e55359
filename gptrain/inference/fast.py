"""The GPU decode loop: one CUDA graph replay per token, and no step waits for the host.

A ``Decoder`` holds, for one batch bucket (1, 2, 4, ... rows; a batch is padded to its bucket with
score-only rows), a static cache and static buffers: the tokens by position, the logits, each row's
sampling settings and the position ``t`` itself, all on the device. One step's graph does a whole
token: it chooses the token at ``t`` from the logits (argmax, or ``sampling.sample`` with its seeded
noise; a row still inside its prompt takes its prompt token), writes it to the token buffer (and its
log-probabilities, when asked), runs the one-token forward at ``t`` (key and value into the cache
with one copy per layer; attention over the cache's first ``L`` positions, ``L`` the power of two
that covers ``t``, one graph per ``L``, under an additive mask of positions ``0 .. t`` taken from a
precomputed table), keeps the logits for ``t + 1`` and advances ``t`` on the device. The host replays
the graphs a few steps ahead of reading the chosen ids back (pinned copies behind events) and applies
``generate``'s stop rules and stream hook there; a row that stopped only costs the steps already
queued. The prefill is ``forward_cached``, eager, once per request.

Not the server's loop (rows.py's, batch invariant, and slots.py's in-flight one over it): this one
stays for ``graph_generate`` (benchmarks, tests). It shares with rows.py the host side (host_loop.py),
the per-row sampling buffers (row_sampling.py) and ``Mode.of``; its own run loop remains because it
steps every row through the prompt positions (Megatron's right-aligned prefill, prompt tokens scored
by the steps) where rows.py starts each row after its own prompt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptrain.inference.generate import EolIds, Generation, SamplingParams, _prompt_logprobs, loop_params, row_done
from gptrain.inference.host_loop import AHEAD, StepReader, capture, model_cache
from gptrain.inference.kv_cache import KVCache, forward_cached
from gptrain.inference.row_sampling import RowSampling
from gptrain.inference.sampling import sample
from gptrain.model.gpt import GPT

MIN_LENGTH = 64  # the shortest attention bucket


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (batch buckets)."""
    return 1 << max(0, (n - 1).bit_length())


def length_bucket(n: int, window: int) -> int:
    """How many cache positions a step that needs ``n`` of them attends over."""
    return min(window, max(MIN_LENGTH, bucket(n)))


@dataclass(frozen=True)
class Mode:
    """What a step's graph does besides the forward (one graph per mode and length bucket)."""
    greedy: bool = True  # every row greedy: argmax only, no sort or noise
    logprobs: bool = False  # the chosen token's log-probability
    top_n: int = 0  # the n most likely tokens and their log-probabilities
    colon: tuple[int, int] | None = None  # (colon id, eol id): no eol right after a colon, per row
    decay: bool = False  # Megatron's top_p decay

    @classmethod
    def of(cls, params, colon: tuple[int, int] | None = None, logprobs: bool = False, top_n: int = 0) -> "Mode":
        """The mode a batch of rows with these ``SamplingParams`` needs (every decode loop's rule)."""
        return cls(greedy=all(p.temperature <= 0 or p.top_k == 1 for p in params), logprobs=logprobs, top_n=top_n,
                   colon=colon, decay=any(p.top_p_decay > 0 for p in params))


def _tail(x, y, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b, norm_w, norm_b, eps2: float,
          eps: float):
    """A block after its attention, and the next LayerNorm (the next block's ln1, or the final
    one): what ``torch.compile`` fuses into a few kernels around the three matmuls."""
    x = x + F.linear(y, proj_w, proj_b)
    h = F.layer_norm(x, x.shape[-1:], ln2_w, ln2_b, eps2)
    x = x + F.linear(F.gelu(F.linear(h, fc1_w, fc1_b), approximate="tanh"), fc2_w, fc2_b)
    return x, F.layer_norm(x, x.shape[-1:], norm_w, norm_b, eps)


_compiled_tail = None


def _linear(x, w, b, gemv: bool):
    """``F.linear``; with ``gemv``, a product over the input dimension in fp32 written as a
    reduction, which Inductor fuses with its prologue and epilogue (a batch of a few rows reads
    the weight at memory speed, where a cuBLAS call at M=1 does not)."""
    if not gemv:
        return F.linear(x, w, b)
    y = (x.unsqueeze(-2).float() * w.float()).sum(-1)
    return (y if b is None else y + b.float()).to(x.dtype)


def _block_step(x, h, kv, at, mask, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b,
                norm_w, norm_b, eps2: float, eps: float, dim: int, length: int, gemv: bool, sdpa: bool):
    """One block's one-token step (``Decoder.forward``'s loop body) and the next LayerNorm, as one
    function for ``torch.compile`` (one compile per batch and attention bucket, reused by every
    layer): ``h`` is the block's input after its ln1; its key and value go into ``kv`` (2, batch,
    heads, window, dim) at ``at``; attention over the first ``length`` positions under ``mask``
    (1, 1, 1, length), through SDPA or (``sdpa`` False) as two fp32 reductions around a softmax."""
    b = x.shape[0]
    qkv = _linear(h, qkv_w, qkv_b, gemv)
    qkv = qkv.view(b, 1, qkv.shape[-1] // (3 * dim), 3, dim).permute(3, 0, 2, 1, 4)  # (3, b, heads, 1, dim)
    kv.index_copy_(3, at, qkv[1:])
    k, v = kv[0, :, :, :length], kv[1, :, :, :length]
    if sdpa:
        y = F.scaled_dot_product_attention(qkv[0], k, v, attn_mask=mask)  # (b, heads, 1, dim)
    else:
        scores = (qkv[0].float() * k.float()).sum(-1) * dim ** -0.5 + mask[0]  # (b, heads, length)
        p = torch.softmax(scores, dim=-1)
        y = (p.unsqueeze(-1) * v.float()).sum(-2).unsqueeze(2).to(x.dtype)  # (b, heads, 1, dim)
    y = y.transpose(1, 2).reshape(b, 1, -1)
    x = x + _linear(y, proj_w, proj_b, gemv)
    h = F.layer_norm(x, x.shape[-1:], ln2_w, ln2_b, eps2)
    x = x + _linear(F.gelu(_linear(h, fc1_w, fc1_b, gemv), approximate="tanh"), fc2_w, fc2_b, gemv)
    return x, F.layer_norm(x, x.shape[-1:], norm_w, norm_b, eps)


def _head(h, w, gemv: bool):
    return _linear(h, w, None, gemv)[:, -1]


_compiled_steps: dict[tuple, tuple] = {}
GEMV_ROWS = 4  # the compiled step's matrix products as reductions up to this many rows, cuBLAS above


def _compiled_step(gemv: bool, sdpa: bool, mode: str | None):
    """The compiled block step and output head (shared by every decoder with these settings)."""
    key = (gemv, sdpa, mode)
    if key not in _compiled_steps:
        import torch._dynamo

        # one compile per (batch bucket, attention bucket, settings): more than dynamo's default 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 1024)
        kw = {"dynamic": False, "fullgraph": True}
        if mode is not None:
            kw["mode"] = mode
        else:
            kw["options"] = {"coordinate_descent_tuning": True}
        _compiled_steps[key] = (torch.compile(_block_step, **kw), torch.compile(_head, **kw))
    return _compiled_steps[key]


def plain_model(model: GPT) -> bool:
    """Whether the blocks are the model's own modules (no kernel swap, no tensor parallelism)."""
    from gptrain.model.gpt import MLP

    norms = [model.final_layernorm] + [m for blk in model.layers.values() for m in (blk.ln1, blk.ln2)]
    linears = [m for blk in model.layers.values() for m in (blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2)]
    return (model.cfg.gpt2_layout  # the decode kernels are GPT-2's; other layers take the generic KV-cache path
            and all(type(m) is torch.nn.LayerNorm and m.weight is not None for m in norms)
            and all(type(m) is torch.nn.Linear for m in linears)
            and all(type(blk.mlp) is MLP for blk in model.layers.values()))


COMPILE_MODES = ("tail", "block")


class Decoder(RowSampling):
    def __init__(self, model: GPT, batch: int, use_graph: bool = True, compile: bool | str = False,
                 gemv: bool | None = None, sdpa: bool | None = None, compile_mode: str | None = None):
        """``compile``: the step through ``torch.compile`` (numerics of fp32 intermediates, not
        eager's roundings). ``"block"`` (or True): each block's whole step (qkv, cache write,
        attention, proj, MLP, the LayerNorms) as one compiled function, and the output head;
        ``gemv`` (default: batch <= GEMV_ROWS) writes its matrix products as fused reductions,
        ``sdpa`` keeps SDPA for the attention (default: where the products are cuBLAS's; measured
        on an H100, 345M, L=256: batch 1 gemv 0.909 ms/step with fused-reduction attention, 0.921
        with SDPA; batch 32 cuBLAS 1.558 ms, 1.413 with SDPA), ``compile_mode`` is torch.compile's mode (None:
        default with coordinate-descent tuning). ``"tail"``: the block after attention only
        (fused LayerNorms, residual adds, biases and GELU around cuBLAS matmuls)."""
        global _compiled_tail
        self.model, self.batch = model, batch
        self.tail = self.block = self.head = None
        if compile is True:
            compile = "block"
        if compile:
            if compile not in COMPILE_MODES:
                raise ValueError(f"compile={compile!r}: one of False, True, {COMPILE_MODES}")
            if not plain_model(model):
                raise ValueError("the compiled decode step needs the model's plain modules (no kernel swap)")
        if compile == "tail":
            if _compiled_tail is None:
                _compiled_tail = torch.compile(_tail, dynamic=False, fullgraph=True)
            self.tail = _compiled_tail
        elif compile == "block":
            self.gemv = batch <= GEMV_ROWS if gemv is None else gemv
            self.sdpa = not self.gemv if sdpa is None else sdpa
            self.block, self.head = _compiled_step(self.gemv, self.sdpa, compile_mode)
        self.window = model.cfg.max_position_embeddings
        self.cache = KVCache(model, batch, self.window)
        dev, dtype = self.cache.kv.device, self.cache.kv.dtype
        self.use_graph = use_graph and dev.type == "cuda"
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, device=dev, dtype=dtype)  # noqa: E731
        self.tokens = zeros(self.window, batch)  # position-major: a step's ids are one contiguous row
        self.prompt_len = zeros(batch)
        self.position = zeros()
        self.logits = zeros(batch, model.output_layer.vocab_size, dtype=dtype)
        self._init_sampling(batch, self.window, dev)
        keys = torch.arange(self.window, device=dev)
        # row t: 0 for key positions 0 .. t, -inf after (SDPA adds it to the scores)
        self.mask_table = torch.zeros(self.window, self.window, device=dev, dtype=dtype).masked_fill(
            keys[None, :] > keys[:, None], float("-inf"))
        self.graphs: dict[tuple[Mode, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # counters and seconds on the host (the decode benchmark's --profile reads them)
        self.stats = {"steps": 0, "replays": 0, "host_waits": 0, "graphs": 0, "requests": 0,
                      "capture_s": 0.0, "prefill_s": 0.0, "loop_s": 0.0, "wait_s": 0.0}
        self.reader = StepReader(self.tokens, self.stats)

    # ---- one step, on the device
    @torch.no_grad()
    def step(self, mode: Mode, length: int) -> None:
        self.forward(self.choose(mode), length)
        self.position.add_(1)

    def choose(self, mode: Mode) -> torch.Tensor:
        """The ids at position ``t`` (batch,), written to the token buffer, from ``self.logits``."""
        b, t = self.batch, self.position
        at = t.view(1)
        logits = self.logits
        if mode.colon is not None:
            colon, eol = mode.colon
            # generated tokens only: a prompt's own newline after a colon is scored as it is
            banned = self.colon_rows & (self.tokens.index_select(0, at - 1)[0] == colon) & (t >= self.prompt_len)
            logits[:, eol] = logits[:, eol].masked_fill(banned, float("-inf"))
        if mode.greedy:
            chosen = logits.argmax(dim=-1)
        else:
            chosen = sample(logits, self.temperature, self.top_k, self.top_p, self.seeds, t.expand(b))
        if mode.decay:
            generating = t >= self.prompt_len
            decayed = torch.maximum(self.top_p * self.decay, self.bound)
            self.top_p.copy_(torch.where(generating & (self.decay > 0) & (self.top_p > 0), decayed, self.top_p))
        chosen = torch.where(t < self.prompt_len, self.tokens.index_select(0, at)[0], chosen)
        self.tokens.index_copy_(0, at, chosen[None])
        if mode.logprobs or mode.top_n:
            self._record_logprobs(logits, chosen, at, mode.top_n)
        return chosen

    def forward(self, chosen: torch.Tensor, length: int) -> None:
        """Logits (into ``self.logits``) of ``chosen`` (batch,) fed at position ``self.position``,
        attending over the cache's first ``length`` positions."""
        model, kv, b = self.model, self.cache.kv, self.batch
        at = self.position.view(1)
        dim = model.cfg.head_dim
        x = model.word_embeddings(chosen[:, None]) + model.position_embeddings(at)
        mask = self.mask_table.index_select(0, at)[None, None, :, :length]  # (1, 1, 1, length)
        blocks = list(model.layers.values())
        h = blocks[0].ln1(x)
        if self.block is not None:
            for i, block in enumerate(blocks):
                norm = blocks[i + 1].ln1 if i + 1 < len(blocks) else model.final_layernorm
                attn, mlp = block.attn, block.mlp
                x, h = self.block(x, h, kv[i], at, mask, attn.qkv.weight, attn.qkv.bias, attn.proj.weight,
                                  attn.proj.bias, block.ln2.weight, block.ln2.bias, mlp.fc1.weight, mlp.fc1.bias,
                                  mlp.fc2.weight, mlp.fc2.bias, norm.weight, norm.bias, block.ln2.eps, norm.eps,
                                  dim, length, self.gemv, self.sdpa)
            out = model.output_layer
            self.logits.copy_(self.head(h, out.weight[: out.vocab_size], self.gemv))
            return
        for i, block in enumerate(blocks):
            qkv = block.attn.qkv(h)
            qkv = qkv.view(b, 1, qkv.shape[-1] // (3 * dim), 3, dim).permute(3, 0, 2, 1, 4)  # (3, b, heads, 1, dim)
            kv[i].index_copy_(3, at, qkv[1:])
            y = F.scaled_dot_product_attention(qkv[0], kv[i, 0, :, :, :length], kv[i, 1, :, :, :length],
                                               attn_mask=mask)
            y = y.transpose(1, 2).reshape(b, 1, -1)
            norm = blocks[i + 1].ln1 if i + 1 < len(blocks) else model.final_layernorm
            if self.tail is None:
                x = x + block.attn.proj(y)
                x = x + block.mlp(block.ln2(x))
                h = norm(x)
            else:
                x, h = self.tail(x, y, block.attn.proj.weight, block.attn.proj.bias, block.ln2.weight,
                                 block.ln2.bias, block.mlp.fc1.weight, block.mlp.fc1.bias, block.mlp.fc2.weight,
                                 block.mlp.fc2.bias, norm.weight, norm.bias, block.ln2.eps, norm.eps)
        self.logits.copy_(model.output_layer(h)[:, -1])

    def _graph(self, mode: Mode, length: int) -> torch.cuda.CUDAGraph:
        """The captured step (captured on first use, before any request state is loaded: the
        warm-up steps write to the buffers)."""
        graph = self.graphs.get((mode, length))
        if graph is None:
            # the graphs never run at once and keep nothing between replays outside the static
            # buffers: they share one memory pool
            graph = capture(lambda: self.step(mode, length), lambda: self.position.fill_(1), self.pool)
            self.pool = graph.pool()
            self.graphs[(mode, length)] = graph
            self.stats["graphs"] += 1
        return graph

    def _issue(self, mode: Mode, t: int) -> None:
        length = length_bucket(t + 1, self.window)
        if self.use_graph:
            self.graphs[(mode, length)].replay()
            self.stats["replays"] += 1
        else:
            self.step(mode, length)
        self.stats["steps"] += 1
        self.reader.issued(t)

    # ---- one request, on the host
    @torch.no_grad()
    def run(self, prompts: list[list[int]], params: list[SamplingParams], logprobs: bool = False,
            top_logprobs: int = 0, eol: EolIds | None = None, on_token=None,
            no_newline_after_colon: list[bool] | None = None) -> list[Generation]:
        """``generate``'s results for up to ``batch`` prompts (its arguments, without ``sync``)."""
        model, window, n = self.model, self.window, len(prompts)
        eol, ends, colon = self._begin_request(prompts, params, eol, no_newline_after_colon)
        lengths = [len(p) for p in prompts]
        start, total = min(lengths), max(ends)
        shortest = lengths.index(start)
        pad = self.batch - n  # copies of the shortest prompt, score only: the prefill stays as long
        rows = list(prompts) + [prompts[shortest]] * pad
        row_params = list(params) + [SamplingParams(max_new_tokens=0, temperature=0.0)] * pad
        want_lp = logprobs or top_logprobs > 0
        mode = Mode.of(row_params, (eol.colon, eol.eol) if any(colon) else None, want_lp, top_logprobs)
        self._top_buffers(top_logprobs)
        begin = time.perf_counter()
        if self.use_graph:  # capture what this request needs before its state goes in
            for length in sorted({length_bucket(t + 1, window) for t in range(start, total)}):
                self._graph(mode, length)
        self.stats["capture_s"] += time.perf_counter() - begin
        self.stats["requests"] += 1
        begin = time.perf_counter()

        grid = torch.zeros(window, self.batch, dtype=torch.long)
        for i, p in enumerate(rows):
            grid[: len(p), i] = torch.tensor(p, dtype=torch.long)
        self.tokens.copy_(grid)
        self.prompt_len.copy_(torch.tensor([len(p) for p in rows]))
        self._load_sampling(row_params, colon)
        self.position.fill_(start)

        out = [Generation(tokens=list(p), prompt_length=len(p)) for p in prompts]
        if want_lp:
            for g in out:
                g.logprobs, g.top_logprobs = [None], [None]
        hidden = forward_cached(model, self.tokens[:start].T, 0, self.cache)
        if want_lp and start > 1:
            _prompt_logprobs(model, hidden[:n, :-1], self.tokens[1:start, :n].T, out, top_logprobs)
        self.logits.copy_(model.output_layer(hidden[:, -1]))
        loop = time.perf_counter()
        self.stats["prefill_s"] += loop - begin  # its launches (the GPU may still be running it)

        done = [length >= end for length, end in zip(lengths, ends)]  # max_new_tokens 0: score only
        count, last = [0] * n, [start - 1] * n  # last: the last position whose log-probability a row keeps
        longest = max(lengths)
        pending = (lambda t: not all(done) or (want_lp and t < longest))  # rows to generate or score
        t = issued = start
        go_on = t < total and pending(t)
        while go_on:
            while issued < total and issued - t < AHEAD:
                self._issue(mode, issued)
                issued += 1
            ids = self.reader.read(t)
            for i in range(n):
                if t < lengths[i]:  # a prompt token: only scored
                    last[i] = t
                    continue
                if done[i]:
                    continue
                token = ids[i]
                out[i].tokens.append(token)
                last[i] = t
                count[i] += 1
                done[i] = row_done(out[i], i, token, count[i], params[i], eol, on_token)
            go_on = t + 1 < total and pending(t + 1)
            t += 1
        self.stats["loop_s"] += time.perf_counter() - loop
        if want_lp and t > start:
            self._append_logprobs(out, start, t, [row_last - start + 1 for row_last in last], top_logprobs)
        return out


def decoder_for(model: GPT, rows: int, use_graph: bool = True, compile: bool | str = False, **kw) -> Decoder:
    """The model's decoder for ``rows`` prompts (one per batch bucket, kept on the model between
    requests); ``kw``: Decoder's compile settings (gemv, sdpa, compile_mode)."""
    decoders = model_cache(model, "_graph_decoders")
    key = (bucket(rows), use_graph, compile, tuple(sorted(kw.items())))
    if key not in decoders:
        decoders[key] = Decoder(model, bucket(rows), use_graph=use_graph, compile=compile, **kw)
    return decoders[key]


def graph_generate(model: GPT, prompts: list[list[int]], params, **kw):
    """``generate`` with the device-resident, CUDA-graph decode loop (same arguments, without
    ``step_fn``, ``cache`` and ``sync``; same results)."""
    if not prompts:
        return []
    params = loop_params("graph_generate", prompts, params, kw)
    settings = {name: kw.pop(name) for name in ("gemv", "sdpa", "compile_mode") if name in kw}
    decoder = decoder_for(model, len(prompts), kw.pop("use_graph", True), kw.pop("compile", False), **settings)
    return decoder.run(list(prompts), params, **kw)
