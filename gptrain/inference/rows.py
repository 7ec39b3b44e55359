"""The fused decode loop: each row of the batch at its own position, one CUDA graph per batch bucket.

``RowDecoder`` prefills each prompt alone (``forward_cached`` on its row of the cache), so a row
starts decoding right after its own prompt, whatever the other rows' lengths. A step's graph
chooses every row's next token from its logits (argmax, or ``sampling.sample``'s seeded noise at
the row's own position), records it, and runs the one-token forward at each row's position
through ``kernels/decode.py``: five kernels a block, attention over the row's own cached
positions. No step depends on the host, and a step's numbers for a row depend only on that row
(the kernels are batch invariant, the prefill is the row's alone): a seeded request gives the same
text alone or batched with any others, and one graph serves every length.

A lone stream that need not match its batched numbers (``batch_invariant=False``, as ``gptrain
generate``) decodes with its block products on the CUDA cores instead (``single_stream``: faster for
one row, different in the last bits).

The host queues a few steps ahead of reading a step's ids back (pinned copies behind events) and
applies ``generate``'s stop rules and stream hook there. Elsewhere than CUDA the same steps run
eagerly with the kernels' PyTorch references (the tests' path).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gptrain.inference.steps import Mode, bucket, fused_decodable, tensor_parallel_group
from gptrain.inference.generate import EolIds, Generation, SamplingParams, _prompt_logprobs, loop_params, row_done
from gptrain.inference.host_loop import AHEAD, StepReader, capture, model_cache
from gptrain.inference.kv_cache import KVCache, forward_cached
from gptrain.inference.row_sampling import RowSampling
from gptrain.inference.sampling import sample
from gptrain.kernels.decode import decode_attention, ln_linear
from gptrain.kernels.decode_io import embed_rows, row_argmax
from gptrain.kernels.ln_fold import refresh_ln_constants
from gptrain.model.gpt import GPT


class RowCache:
    """Rows ``first .. first + rows - 1`` of a decoder's cache, as ``forward_cached`` takes a cache."""

    def __init__(self, kv: torch.Tensor, first: int, rows: int = 1):
        self.kv = kv[:, :, first:first + rows]
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.max_len = kv.shape[-2]


def prefill_bucket(length: int, window: int) -> int:
    """The padded length a prompt is prefilled at on CUDA: a power of two from 16, at most the window."""
    return min(window, max(16, 1 << (length - 1).bit_length()))


class PrefillGraphs:
    """One prompt's forward pass as a CUDA graph per padded length (``prefill_bucket``): the prompt's
    tokens, zeros after them, through ``forward_cached`` into a one-row staging cache; the final
    hidden states and the last prompt position's logits into static buffers. Padding after the
    prompt changes nothing before it (attention is causal), and a prompt always takes the same
    graph, so its numbers never depend on the batch; one replay replaces hundreds of launches."""

    def __init__(self, model: GPT, window: int, use_graph: bool = True):
        self.model, self.window = model, window
        self.use_graph = use_graph and model.word_embeddings.weight.is_cuda
        param = model.word_embeddings.weight
        dev = param.device
        self.cache = KVCache(model, 1, window)
        self.tokens = torch.zeros(1, window, device=dev, dtype=torch.long)
        self.last = torch.zeros(1, device=dev, dtype=torch.long)
        self.hidden = torch.zeros(1, window, model.cfg.hidden_size, device=dev, dtype=param.dtype)
        self.logits = torch.zeros(1, model.output_layer.vocab_size, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _forward(self, length: int) -> None:
        hidden = forward_cached(self.model, self.tokens[:, :length], 0, self.cache)
        self.hidden[:, :length].copy_(hidden)
        self.logits.copy_(self.model.output_layer(hidden.index_select(1, self.last)[:, 0]).float())

    def run(self, prompt: list[int]) -> int:
        """Prefills ``prompt`` into the staging cache; returns its padded length."""
        length = prefill_bucket(len(prompt), self.window)
        padded = torch.zeros(length, dtype=torch.long)
        padded[:len(prompt)] = torch.tensor(prompt)
        self.tokens[0, :length].copy_(padded, non_blocking=True)
        self.last.fill_(len(prompt) - 1)
        if not self.use_graph:
            self._forward(length)
            return length
        graph = self.graphs.get(length)
        if graph is None:
            graph = capture(lambda: self._forward(length), lambda: None, self.pool, warmups=1)
            self.pool = graph.pool()
            self.graphs[length] = graph
        graph.replay()
        return length


class RowDecoder(RowSampling):
    """``single_stream``: one row only, its block products on the CUDA cores (``ln_linear``'s gemv:
    faster for one row; its numbers differ from the batched kernels' in the last bits, so a seeded
    text can differ from the same request's in a batch).

    A model split over tensor-parallel ranks (``inference/tensor_parallel.localize``) runs the same
    step on every rank: each holds its heads' share of the cache and of QKV and fc1, the attention
    projection and fc2 write their partial sums (rank 0's with the residual and the bias) into the
    residual stream and one all-reduce adds them up, and the embeddings and the output layer are
    whole on every rank (gathered once, ``_whole_tables``), so a step has two all-reduces a block
    and one broadcast of rank 0's chosen ids (every rank records the same ids, so every rank's host
    loop stops at the same step). Every collective is inside the step's graph: no host sync."""

    def __init__(self, model: GPT, batch: int, use_graph: bool = True, single_stream: bool = False):
        if not fused_decodable(model):
            raise ValueError("the fused decode step needs GPT-2's layers on the model's own modules (no "
                             "kernel swap), on one process or split by tensor parallelism")
        if single_stream and batch != 1:
            raise ValueError(f"a single-stream decoder has one row, not {batch}")
        self.model, self.batch, self.gemv = model, batch, single_stream
        self.window = window = model.cfg.max_position_embeddings
        param = model.word_embeddings.weight
        dev, dtype = param.device, param.dtype
        cfg = model.cfg
        # (layers, 2, batch, heads, window, dim): a layer's slice is what decode_attention takes
        heads = model.layers["0"].attn.qkv.weight.shape[0] // (3 * cfg.head_dim)  # this rank's
        self.kv = torch.zeros(cfg.num_layers, 2, batch, heads, window, cfg.head_dim, device=dev, dtype=dtype)
        self.group = tensor_parallel_group(model)
        self.lead = self.group is None or dist.get_rank(self.group) == 0
        self.word, self.head = _whole_tables(model)
        self.use_graph = use_graph and dev.type == "cuda"
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, device=dev, dtype=dtype)  # noqa: E731
        self.step_index = zeros()  # steps done in this request
        self.start = zeros(batch)  # each row's prompt length: the position of its first new token
        self.current = zeros(batch)  # the ids fed last (a prompt's last token before the first step)
        self.out = zeros(window, batch)  # the chosen ids, step-major
        # logits in rows padded to a multiple of 64 columns (-inf there, never chosen): each row starts
        # aligned, so the softmax and sort kernels group a row's values the same way in any batch
        vocab = model.output_layer.vocab_size
        self.padded_logits = torch.full((batch, -(-vocab // 64) * 64), float("-inf"), device=dev)
        self.logits = self.padded_logits[:, :vocab]
        self.chosen, self.positions = zeros(batch), zeros(batch)  # a step's ids, and where each row feeds them
        self.x = zeros(batch, cfg.hidden_size, dtype=dtype)  # the residual stream of a step
        self._init_sampling(batch, window, dev)
        self.graphs: dict[Mode, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.prefill_graphs = prefill_graphs_for(model) if self.use_graph else None
        self.stats = {"steps": 0, "replays": 0, "host_waits": 0, "graphs": 0, "requests": 0,
                      "capture_s": 0.0, "prefill_s": 0.0, "loop_s": 0.0, "wait_s": 0.0}
        self.reader = StepReader(self.out, self.stats)

    # ---- one step, on the device
    @torch.no_grad()
    def step(self, mode: Mode, rows: int | None = None, out: torch.Tensor | None = None) -> None:
        """One step of the first ``rows`` rows (default: all), their ids into ``out`` (window, rows)
        (default ``self.out``): the in-flight decoder (slots.py) steps a prefix of its slots."""
        self.forward(self.choose(mode, rows), rows, out)
        self.step_index.add_(1)

    def choose(self, mode: Mode, rows: int | None = None) -> torch.Tensor:
        """Each of the first ``rows`` rows' next id from ``self.logits``, recorded at this step."""
        b = rows or self.batch
        at = self.step_index.view(1)
        logits = self.padded_logits[:b]
        if mode.colon is not None:
            colon, eol = mode.colon
            banned = self.colon_rows[:b] & (self.current[:b] == colon)
            logits[:, eol] = logits[:, eol].masked_fill(banned, float("-inf"))
        if mode.greedy:
            chosen = row_argmax(self.logits[:b], out=self.chosen[:b])
        else:
            chosen = sample(logits, self.temperature[:b], self.top_k[:b], self.top_p[:b], self.seeds[:b],
                            self.start[:b] + self.step_index)
        if mode.decay:
            top_p, decay = self.top_p[:b], self.decay[:b]
            decayed = torch.maximum(top_p * decay, self.bound[:b])
            top_p.copy_(torch.where((decay > 0) & (top_p > 0), decayed, top_p))
        if self.group is not None:  # every rank feeds and records rank 0's ids
            dist.broadcast(chosen, src=dist.get_global_rank(self.group, 0), group=self.group)
        if mode.logprobs or mode.top_n:
            self._record_logprobs(logits, chosen, at, mode.top_n)
        return chosen

    def forward(self, chosen: torch.Tensor, rows: int | None = None, out: torch.Tensor | None = None) -> None:
        """Records ``chosen`` (rows,) as this step's ids and puts its logits into ``self.logits``,
        each fed at its row's position (a row past the window, already finished, repeats the last
        position)."""
        model, b = self.model, rows or self.batch
        x, positions = self.x[:b], self.positions[:b]
        embed_rows(chosen, self.start[:b], self.step_index, self.word, model.position_embeddings.weight, x,
                   positions, self.out if out is None else out, self.current[:b])
        gemv = self.gemv
        for i, block in enumerate(model.layers.values()):
            attn, mlp = block.attn, block.mlp
            qkv = ln_linear(x, attn.qkv.weight, attn.qkv.bias, ln=block.ln1, gemv=gemv)
            y = decode_attention(qkv, self.kv[i], positions)
            self._add_product(y, attn.proj, x)
            h = ln_linear(x, mlp.fc1.weight, mlp.fc1.bias, ln=block.ln2, gelu=True, gemv=gemv)
            self._add_product(h, mlp.fc2, x)
        ln_linear(x, self.head, ln=model.final_layernorm, out=self.logits[:b])

    def _add_product(self, inputs: torch.Tensor, linear, x: torch.Tensor) -> None:
        """``x += inputs @ W.T + b`` in one kernel; under tensor parallelism each rank's share of the
        product (rank 0's with ``x`` and ``b``) into ``x``, summed over the ranks by one all-reduce."""
        if self.lead:
            ln_linear(inputs, linear.weight, linear.bias, residual=x, out=x, gemv=self.gemv)
        else:
            ln_linear(inputs, linear.weight, out=x, gemv=self.gemv)
        if self.group is not None:
            dist.all_reduce(x, group=self.group)

    def _graph(self, mode: Mode) -> torch.cuda.CUDAGraph:
        """The captured step (captured before a request's state goes in: warm-up steps write the
        buffers and the cache)."""
        graph = self.graphs.get(mode)
        if graph is None:
            graph = capture(lambda: self.step(mode), self.step_index.zero_, self.pool)
            self.pool = graph.pool()
            self.graphs[mode] = graph
            self.stats["graphs"] += 1
        return graph

    def _issue(self, mode: Mode, s: int) -> None:
        if self.use_graph:
            self.graphs[mode].replay()
            self.stats["replays"] += 1
        else:
            self.step(mode)
        self.stats["steps"] += 1
        self.reader.issued(s)

    # ---- one request, on the host
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], out: list[Generation], top_logprobs: int, want_lp: bool,
                together: bool) -> None:
        """Each prompt's keys and values into its row of the cache and its last logits into
        ``self.logits``; alone (``together`` False: on CUDA through ``PrefillGraphs``) or, for prompts
        of one length, in one call."""
        model, dev = self.model, self.logits.device
        if self.prefill_graphs is not None and not together:
            graphs = self.prefill_graphs
            for row, prompt in enumerate(prompts):
                length = graphs.run(prompt)
                self.kv[:, :, row, :, :length].copy_(graphs.cache.kv[:, :, 0, :, :length])
                self.logits[row].copy_(graphs.logits[0])
                if want_lp and len(prompt) > 1:
                    tokens = torch.tensor([prompt], device=dev)
                    _prompt_logprobs(model, graphs.hidden[:, :len(prompt) - 1], tokens[:, 1:], out[row:row + 1],
                                     top_logprobs)
            return
        groups = [list(range(len(prompts)))] if together and len({len(p) for p in prompts}) == 1 else \
            [[i] for i in range(len(prompts))]
        for rows in groups:
            first = rows[0]
            tokens = torch.tensor([prompts[i] for i in rows], device=dev)
            hidden = forward_cached(model, tokens, 0, RowCache(self.kv, first, len(rows)))
            if want_lp and tokens.shape[1] > 1:
                _prompt_logprobs(model, hidden[:, :-1], tokens[:, 1:], out[first:first + len(rows)], top_logprobs)
            self.logits[first:first + len(rows)] = model.output_layer(hidden[:, -1]).float()

    @torch.no_grad()
    def run(self, prompts: list[list[int]], params: list[SamplingParams], logprobs: bool = False,
            top_logprobs: int = 0, eol: EolIds | None = None, on_token=None,
            no_newline_after_colon: list[bool] | None = None, together: bool = False) -> list[Generation]:
        """``generate``'s results for up to ``batch`` prompts (its arguments, without ``sync``);
        ``together`` prefills prompts of one length in one call (faster for a large batch, but a
        row's numbers then depend on the batch)."""
        n = len(prompts)
        eol, ends, colon = self._begin_request(prompts, params, eol, no_newline_after_colon)
        want_lp = logprobs or top_logprobs > 0
        mode = Mode.of(params, (eol.colon, eol.eol) if any(colon[:n]) else None, want_lp, top_logprobs)
        self._top_buffers(top_logprobs)
        begin = time.perf_counter()
        if self.use_graph:
            self._graph(mode)
            refresh_ln_constants()  # weights changed in place since the last request
        self.stats["capture_s"] += time.perf_counter() - begin
        self.stats["requests"] += 1
        begin = time.perf_counter()

        out = [Generation(tokens=list(p), prompt_length=len(p)) for p in prompts]
        if want_lp:
            for g in out:
                g.logprobs, g.top_logprobs = [None], [None]
        pad = self.batch - n  # padding rows: a one-token prompt at position 0, never read back
        lengths = [len(p) for p in prompts] + [1] * pad
        row_params = list(params) + [SamplingParams(max_new_tokens=0, temperature=0.0)] * pad
        self.logits.zero_()  # padding rows' logits: finite
        self.prefill(prompts, out, top_logprobs, want_lp, together)
        self.start.copy_(torch.tensor(lengths))
        self.current.copy_(torch.tensor([p[-1] for p in prompts] + [0] * pad))
        self._load_sampling(row_params, colon)
        self.step_index.zero_()
        loop = time.perf_counter()
        self.stats["prefill_s"] += loop - begin

        done = [len(p) >= end for p, end in zip(prompts, ends)]  # max_new_tokens 0: score only
        count = [0] * n
        # under tensor parallelism every rank must run the same steps, so only the rules every rank sees
        # (the ids, the settings) end a row; the stream hook, rank 0's alone (a stop string, a client gone),
        # ends its output there and the row decodes on in step with the other ranks
        lockstep, cut = self.group is not None, [None] * n
        hook = None if lockstep else on_token
        total = max(end - len(p) for p, end in zip(prompts, ends))  # steps the longest row needs
        s = issued = 0
        while s < total and not all(done):
            while issued < total and issued - s < AHEAD:
                self._issue(mode, issued)
                issued += 1
            ids = self.reader.read(s)
            for i in range(n):
                if done[i]:
                    continue
                token = ids[i]
                out[i].tokens.append(token)
                count[i] += 1
                done[i] = row_done(out[i], i, token, count[i], params[i], eol, hook)
                if lockstep and on_token is not None and cut[i] is None and on_token(i, token):
                    cut[i] = count[i]
            s += 1
        for i, kept in enumerate(cut):
            if kept is not None:
                del out[i].tokens[out[i].prompt_length + kept:]
                out[i].finish_reason, count[i] = "stop", kept
        self.stats["loop_s"] += time.perf_counter() - loop
        if want_lp and s:
            self._append_logprobs(out, 0, s, count, top_logprobs)
        return out


def _whole_tables(model: GPT) -> tuple[torch.Tensor, torch.Tensor]:
    """The word embeddings and the output layer's weight over the real vocabulary: the model's own on
    one process; under tensor parallelism each rank's vocabulary shards all-gathered once (rank order
    is vocabulary order) and kept on the model for its decoders (a tied output layer shares the
    table)."""
    head = model.output_layer
    group = tensor_parallel_group(model)
    if group is None:
        return model.word_embeddings.weight, head.weight[: head.vocab_size]
    cache = model_cache(model, "_row_decoders")
    if "tables" not in cache:
        def whole(local: torch.Tensor) -> torch.Tensor:
            full = local.new_empty((local.shape[0] * dist.get_world_size(group), local.shape[1]))
            dist.all_gather_into_tensor(full, local.contiguous(), group=group)
            return full[: head.vocab_size]

        word = whole(model.word_embeddings.weight.detach())
        tied = head.weight is model.word_embeddings.weight
        cache["tables"] = (word, word if tied else whole(head.weight.detach()))
    return cache["tables"]


def prefill_graphs_for(model: GPT) -> PrefillGraphs:
    """The model's prompt graphs, shared by its decoders (a request's prompts go through one at a
    time), kept on the model."""
    cache = model_cache(model, "_row_decoders")
    if "prefill" not in cache:
        cache["prefill"] = PrefillGraphs(model, model.cfg.max_position_embeddings)
    return cache["prefill"]


def row_decoder_for(model: GPT, rows: int, use_graph: bool = True, batch_invariant: bool = True) -> RowDecoder:
    """The model's decoder for ``rows`` prompts (one per batch bucket, kept on the model between
    requests); without ``batch_invariant`` one prompt gets the single-stream decoder."""
    cache = model_cache(model, "_row_decoders")
    single = not batch_invariant and bucket(rows) == 1
    key = (bucket(rows), use_graph) + (("single",) if single else ())
    if key not in cache:
        cache[key] = RowDecoder(model, bucket(rows), use_graph=use_graph, single_stream=single)
    return cache[key]


def fused_generate(model: GPT, prompts: list[list[int]], params, **kw) -> list[Generation]:
    """``generate`` through ``RowDecoder`` (same arguments, without ``step_fn``, ``cache`` and
    ``sync``; ``use_graph`` and ``together`` as RowDecoder's). ``batch_invariant`` (default True):
    a request's numbers do not depend on its batch; False lets one prompt decode through the
    single-stream decoder (faster; for a lone stream, as ``gptrain generate``)."""
    if not prompts:
        return []
    params = loop_params("fused_generate", prompts, params, kw)
    decoder = row_decoder_for(model, len(prompts), kw.pop("use_graph", True), kw.pop("batch_invariant", True))
    return decoder.run(list(prompts), params, **kw)


def warm_up(model: GPT, max_rows: int) -> int:
    """Compiles the kernels and captures the graphs that a server's first requests would otherwise
    wait for: the prompt graph of every padded length, and the greedy and the sampled step of each
    batch bucket up to ``max_rows``. Returns the largest bucket warmed: it stops at the first that
    does not fit in the GPU's memory (larger batches then fail as they would have anyway)."""
    window = model.cfg.max_position_embeddings
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=1, temperature=1.0, seed=0)
    lengths = sorted({min(prefill_bucket(n, window), window - 1) for n in range(1, window)})
    warmed, rows = 0, 1
    try:
        for length in lengths:
            fused_generate(model, [[0] * length], greedy)
        while rows <= bucket(max_rows):
            fused_generate(model, [[0]] * rows, greedy)
            fused_generate(model, [[0]] * rows, [sampled] * rows)
            warmed, rows = rows, rows * 2
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
    return warmed
