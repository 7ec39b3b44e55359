"""Megatron-LM's ``PUT /api`` (tools/run_text_generation_server.py): its request fields, limits and
response, except that every invalid request is HTTP 400 ``{"error": "<field>: <why>"}`` and every
accepted field takes effect (Megatron parses random_seed, stop_token, add_BOS, ... and then ignores
some of them)."""
from __future__ import annotations

import secrets

from gptrain.inference.generate import Generation, SamplingParams
from gptrain.serve.engine import Job

MAX_PROMPTS = 128
FIELDS = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "top_p_decay",
          "top_p_bound", "add_BOS", "stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon",
          "random_seed", "no_log", "beam_width", "stop_token", "length_penalty"}


class BadRequest(ValueError):
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_field(name: str, value, lo: int, hi: int | None = None) -> int:
    """``value`` if it is an integer in [lo, hi] (>= lo without ``hi``); else BadRequest naming ``name``."""
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name}: must be an integer {where}, got {value!r}")
    return value


def number_field(name: str, value, lo: float, hi: float, open_low: bool = False, shown: str | None = None):
    """``value`` if it is a number in [lo, hi] ((lo, hi] with ``open_low``); else BadRequest naming
    ``name`` and the interval (``shown``, or the bounds)."""
    if not _is_number(value) or not (lo < value <= hi if open_low else lo <= value <= hi):
        where = shown or f"{'(' if open_low else '['}{lo}, {hi}]"
        raise BadRequest(f"{name}: must be a number in {where}, got {value!r}")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name}: must be a boolean, got {value!r}")
    return value


def parse_request(body, tokenizer, window: int) -> tuple[Job, bool]:
    """The engine job of a ``PUT /api`` body, and whether the request asked not to be logged."""
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    if "max_len" in body:
        raise BadRequest("max_len: no longer used; replace with tokens_to_generate")
    if "sentences" in body:
        raise BadRequest("sentences: no longer used; replace with prompts")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field (accepted: {', '.join(sorted(FIELDS))})")
    if "prompts" not in body:
        raise BadRequest("prompts: required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompts: must be a list of strings")
    if not prompts:
        raise BadRequest("prompts: is empty")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompts: {len(prompts)} given, at most {MAX_PROMPTS}")
    tokens_to_generate = int_field("tokens_to_generate", body.get("tokens_to_generate", 64), 0)
    logprobs = _bool(body, "logprobs")
    temperature = number_field("temperature", body.get("temperature", 1.0), 0, 100, open_low=True)
    top_k = int_field("top_k", body.get("top_k", 0), 0, 1000)
    top_p = number_field("top_p", body.get("top_p", 0.0), 0, 1)
    if top_p > 0 and top_k > 0:
        raise BadRequest("top_p: cannot be set together with top_k (choose top-k or top-p sampling)")
    top_p_decay = number_field("top_p_decay", body.get("top_p_decay", 0.0), 0, 1)
    if top_p_decay > 0 and top_p == 0:
        raise BadRequest("top_p_decay: needs top_p > 0")
    top_p_bound = number_field("top_p_bound", body.get("top_p_bound", 0.0), 0, top_p, shown=f"[0, top_p={top_p}]")
    add_bos = _bool(body, "add_BOS")
    if any(p == "" for p in prompts) and not add_bos:
        raise BadRequest("prompts: an empty prompt needs add_BOS=true")
    stop_on_double_eol = _bool(body, "stop_on_double_eol")
    stop_on_eol = _bool(body, "stop_on_eol")
    no_colon_newline = _bool(body, "prevent_newline_after_colon")
    no_log = _bool(body, "no_log")
    seed = body.get("random_seed", -1)
    if not _is_int(seed) or (seed < 0 and seed != -1) or seed >= 2 ** 63:
        raise BadRequest(f"random_seed: must be an integer >= 0 (or -1: random), got {seed!r}")
    beam_width = body.get("beam_width")
    if beam_width is not None:
        raise BadRequest("beam_width: beam search is not implemented by this server")
    length_penalty = body.get("length_penalty", 1)
    if not _is_number(length_penalty) or length_penalty != 1:
        raise BadRequest("length_penalty: only applies to beam search, which this server does not implement")
    stop_token = body.get("stop_token", tokenizer.eod)
    if not _is_int(stop_token) or not 0 <= stop_token < tokenizer.vocab_size:
        raise BadRequest(f"stop_token: must be a token id in [0, {tokenizer.vocab_size}), got {stop_token!r}")

    encoded = [([tokenizer.eod] if add_bos else []) + tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(encoded):
        if len(ids) + tokens_to_generate > window:
            raise BadRequest(f"prompts: prompt {i} has {len(ids)} tokens and tokens_to_generate is {tokens_to_generate}: "
                             f"{len(ids) + tokens_to_generate} exceeds the model's context of {window} tokens")
    if seed == -1:
        seed = secrets.randbits(62)
    params = SamplingParams(max_new_tokens=tokens_to_generate, temperature=float(temperature), top_k=top_k,
                            top_p=float(top_p), top_p_decay=float(top_p_decay), top_p_bound=float(top_p_bound),
                            seed=seed, stop_ids=(stop_token,), stop_on_eol=stop_on_eol,
                            stop_on_double_eol=stop_on_double_eol)
    job = Job(prompts=encoded, params=[params] * len(encoded), logprobs=logprobs,
              no_newline_after_colon=no_colon_newline)
    return job, no_log


def response(results: list[Generation], tokenizer, logprobs: bool) -> dict:
    """Megatron's answer: the full texts (prompt + generation), each token's text, the log-probabilities
    of tokens 1.. (given the ones before), and the token ids."""
    return {
        "text": [tokenizer.decode(g.tokens) for g in results],
        "segments": [tokenizer.token_texts(g.tokens) for g in results],
        "logprobs": [g.logprobs[1:] for g in results] if logprobs else None,
        "tokens": [g.tokens for g in results],
    }
