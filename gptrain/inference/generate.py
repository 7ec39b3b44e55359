"""Batched generation with a KV cache: prompts of different lengths, per-row sampling settings,
stop conditions and log-probabilities.

Prompts are right-aligned to position 0, as Megatron does: the batch is prefilled up to the
shortest prompt, then advances one position per step; a row still inside its prompt takes its
prompt token instead of the sample. Every row thus holds real tokens at every position before the
current one, so the only mask is the causal one. Per step, one small tensor (the chosen ids, with
their log-probabilities when asked) is copied to the host; the stop rules run there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from gptrain.inference.kv_cache import KVCache, forward_cached, logits_of
from gptrain.inference.sampling import sample
from gptrain.model.gpt import GPT


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: no limit; 1: greedy
    top_p: float = 0.0  # 0: no nucleus filter
    top_p_decay: float = 0.0  # Megatron's: after each token top_p *= decay, not below top_p_bound
    top_p_bound: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # ids that end the row (kept in its tokens, as Megatron keeps eod)
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False


@dataclass
class Generation:
    tokens: list[int]  # prompt + generated
    prompt_length: int
    finish_reason: str = "length"  # "length" or "stop"
    # log-probability of each token given the ones before it (None for the first), when asked
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]


@dataclass
class EolIds:
    """GPT-2's "\\n", "\\n\\n" and ":" ids (Megatron's stop_on_eol / stop_on_double_eol /
    prevent_newline_after_colon rules)."""
    eol: int = 198
    double_eol: int = 628
    colon: int = 25


def _stops(params: SamplingParams, token: int, previous: int, eol: EolIds) -> bool:
    if token in params.stop_ids:
        return True
    if params.stop_on_double_eol:
        return token == eol.double_eol or (token == eol.eol and previous == eol.eol)
    if params.stop_on_eol:
        return token in (eol.eol, eol.double_eol)
    return False


def row_done(g: Generation, row: int, token: int, made: int, params: SamplingParams, eol: EolIds,
             on_token=None) -> bool:
    """After row ``row``'s ``made``-th new token (already in ``g.tokens``): whether the row is done.
    A stop rule or the stream hook (``on_token(row, token)`` returning true) ends it with
    ``finish_reason`` "stop"; reaching ``max_new_tokens`` ends it as it is."""
    stop = _stops(params, token, g.tokens[-2], eol)
    if on_token is not None and on_token(row, token):
        stop = True
    if stop:
        g.finish_reason = "stop"
        return True
    return made >= params.max_new_tokens


def loop_params(caller: str, prompts: list[list[int]], params, kw: dict) -> list[SamplingParams]:
    """For a decode loop that stands in for ``generate`` (``caller``): one ``SamplingParams`` per
    prompt, after refusing ``generate``'s ``step_fn``, ``cache`` and ``sync`` in ``kw`` (popped)."""
    for name in ("step_fn", "cache", "sync"):
        if kw.pop(name, None) is not None:
            raise ValueError(f"{caller} does not take {name}")
    return [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)


def check_request(prompts: list[list[int]], params: list[SamplingParams], window: int) -> list[int]:
    """Each row's end (prompt + new tokens); a ValueError names a row that does not fit."""
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    ends = [n + p.max_new_tokens for n, p in zip(lengths, params)]
    if max(ends) > window:
        row = ends.index(max(ends))
        raise ValueError(f"prompt {row} has {lengths[row]} tokens and asks for {params[row].max_new_tokens} more: "
                         f"{ends[row]} exceeds the model's {window} positions")
    return ends


@torch.no_grad()
def generate(model: GPT, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
             logprobs: bool = False, top_logprobs: int = 0, eol: EolIds | None = None,
             on_token: Callable[[int, int], bool | None] | None = None, cache: KVCache | None = None,
             step_fn=None, no_newline_after_colon: list[bool] | None = None, sync=None) -> list[Generation]:
    """Generate for each prompt. ``on_token(row, token)`` is called for every generated token (a
    streaming hook; returning True ends that row, finish_reason "stop"). ``logprobs`` returns each
    token's log-probability (prompt tokens included), ``top_logprobs`` the n most likely tokens at
    each position. ``step_fn(tokens, position)`` replaces the one-token forward (the CUDA-graph
    decoder) and returns (batch, vocab) logits. ``no_newline_after_colon`` (per row) forbids "\\n"
    right after ":". ``sync(chosen, go_on)`` (tensor parallelism) returns rank 0's chosen ids and
    whether it goes on, so every rank feeds the same tokens and stops at the same step."""
    if not prompts:
        return []
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    eol = eol or EolIds()
    model.eval()
    device = model.word_embeddings.weight.device
    lengths = [len(p) for p in prompts]
    ends = check_request(prompts, params, model.cfg.max_position_embeddings)
    b, total = len(prompts), max(ends)
    tokens = torch.zeros(b, max(total, max(lengths)), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    tokens_dev = tokens.to(device)
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], device=device, dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
    seeds = torch.tensor([p.seed for p in params], device=device, dtype=torch.long)
    decay = torch.tensor([p.top_p_decay for p in params], device=device, dtype=torch.float32)
    bound = torch.tensor([p.top_p_bound for p in params], device=device, dtype=torch.float32)
    decaying = bool((decay > 0).any())
    all_greedy = all(p.temperature <= 0 or p.top_k == 1 for p in params)
    colon_rows = (torch.tensor(no_newline_after_colon, device=device)
                  if no_newline_after_colon and any(no_newline_after_colon) else None)
    prompt_len = torch.tensor(lengths, device=device)
    out = [Generation(tokens=list(p), prompt_length=len(p)) for p in prompts]
    want_lp = logprobs or top_logprobs > 0
    if want_lp:
        for g in out:
            g.logprobs = [None]
            g.top_logprobs = [None]
    cache = cache or KVCache(model, b, total)

    start = min(lengths)
    hidden = forward_cached(model, tokens_dev[:, :start], 0, cache)
    if want_lp and start > 1:
        _prompt_logprobs(model, hidden[:, :-1], tokens_dev[:, 1:start], out, top_logprobs)
    logits = logits_of(model, hidden[:, -1])
    done = [n >= e for n, e in zip(lengths, ends)]  # max_new_tokens 0: score only
    count = [0] * b
    t = start
    pending = (lambda t: not all(done) or (want_lp and t < max(lengths)))  # rows to generate or score
    go_on = t < total and pending(t)  # the same on every rank: no stream hook has run yet
    while go_on:
        if colon_rows is not None:
            # only a generated token is constrained: a prompt's newline after a colon is scored as it is
            banned = colon_rows & (tokens_dev[:, t - 1] == eol.colon) & (t >= prompt_len)
            logits[:, eol.eol] = logits[:, eol.eol].masked_fill(banned, float("-inf"))
        if all_greedy:
            chosen = logits.argmax(dim=-1)
        else:
            chosen = sample(logits, temperature, top_k, top_p, seeds, torch.full_like(seeds, t))
        if decaying:
            generating = t >= prompt_len
            decayed = torch.maximum(top_p * decay, bound)
            top_p = torch.where(generating & (decay > 0) & (top_p > 0), decayed, top_p)
        chosen = torch.where(t < prompt_len, tokens_dev[:, t], chosen)
        tokens_dev[:, t] = chosen
        host = [chosen]
        if want_lp:
            lp = torch.log_softmax(logits, dim=-1)
            host.append(lp.gather(1, chosen[:, None])[:, 0].double())
            if top_logprobs:
                top = lp.topk(top_logprobs, dim=-1)
                host += [top.values.double(), top.indices]
        host = [h.cpu() for h in host]
        ids = host[0].tolist()
        for i in range(b):
            if t < lengths[i]:  # a prompt token: only scored
                if want_lp:
                    _record(out[i], host, i, top_logprobs)
                continue
            if done[i]:
                continue
            token = ids[i]
            out[i].tokens.append(token)
            if want_lp:
                _record(out[i], host, i, top_logprobs)
            count[i] += 1
            done[i] = row_done(out[i], i, token, count[i], params[i], eol, on_token)
        go_on = t + 1 < total and pending(t + 1)
        if sync is not None:
            chosen, go_on = sync(chosen, go_on)
            tokens_dev[:, t] = chosen
        if not go_on:
            break
        if step_fn is not None:
            logits = step_fn(chosen[:, None], t)
        else:
            logits = logits_of(model, forward_cached(model, chosen[:, None], t, cache)[:, -1])
        t += 1
    return out


def _record(g: Generation, host: list[torch.Tensor], i: int, top_n: int) -> None:
    g.logprobs.append(float(host[1][i]))
    if top_n:
        g.top_logprobs.append({int(k): float(v) for k, v in zip(host[3][i].tolist(), host[2][i].tolist())})


def _prompt_logprobs(model: GPT, hidden: torch.Tensor, targets: torch.Tensor, out: list[Generation],
                     top_n: int, chunk: int = 128) -> None:
    """Log-probabilities of the prefilled prompt tokens 1 .. start-1, a chunk of positions at a time
    (the whole (batch, seq, vocab) logits are never held)."""
    for s in range(0, hidden.shape[1], chunk):
        lp = torch.log_softmax(logits_of(model, hidden[:, s:s + chunk]), dim=-1)
        picked = lp.gather(2, targets[:, s:s + chunk, None])[..., 0].double().cpu()
        if top_n:
            top = lp.topk(top_n, dim=-1)
            values, indices = top.values.double().cpu(), top.indices.cpu()
        for i, g in enumerate(out):
            for j in range(picked.shape[1]):
                g.logprobs.append(float(picked[i, j]))
                if top_n:
                    g.top_logprobs.append({int(k): float(v) for k, v in zip(indices[i, j].tolist(), values[i, j].tolist())})


def greedy(model: GPT, prompt: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
    """The greedy continuation of one prompt without the stop token (the demo's sample). Prompts
    longer than the model's positions keep their last tokens."""
    window = model.cfg.max_position_embeddings
    max_new_tokens = min(max_new_tokens, window - 1)
    prompt = list(prompt)[-(window - max_new_tokens):]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_ids=() if stop_id is None else (stop_id,))
    generated = generate(model, [prompt], params)[0].generated
    return generated[:-1] if generated and generated[-1] == stop_id else generated
