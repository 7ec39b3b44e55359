"""OpenAI's legacy completions API (``POST /v1/completions``): request validation, the response and
its server-sent-event chunks. Prompts are text, token ids, or lists of either; ``echo`` with
``logprobs`` scores the prompt (what lm-evaluation-harness's loglikelihood requests do)."""
from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass

from gptrain.inference.generate import Generation, SamplingParams
from gptrain.serve.megatron_api import BadRequest, _is_int, _is_number, int_field, number_field

FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "logprobs", "echo",
          "seed", "stream", "user", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "suffix",
          "stream_options"}
MAX_PROMPTS = 128
MAX_N = 16
MAX_LOGPROBS = 5


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice: prompt-major, n per prompt
    n: int
    stops: list[str]
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    model: str


def parse_request(body, tokenizer, window: int, model_name: str) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown or unsupported field")
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise BadRequest(f"model: must be a string, got {model!r}")
    prompts = _prompts(body.get("prompt"), tokenizer)
    max_tokens = body.get("max_tokens", 16)
    max_tokens = int_field("max_tokens", 16 if max_tokens is None else max_tokens, 0)
    temperature = body.get("temperature", 1.0)
    temperature = number_field("temperature", 1.0 if temperature is None else temperature, 0, 100)
    top_p = body.get("top_p", 1.0)
    top_p = number_field("top_p", 1.0 if top_p is None else top_p, 0, 1, open_low=True)
    top_k = int_field("top_k", body.get("top_k", 0), 0, 1000)
    n = int_field("n", body.get("n", 1), 1, MAX_N)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest("best_of: only best_of == n is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name, 0)
        if not _is_number(value) or value != 0:
            raise BadRequest(f"{name}: only 0 is supported, got {value!r}")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias: not supported")
    if body.get("suffix"):
        raise BadRequest("suffix: not supported")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop: must be a non-empty string or a list of at most 4, got {stop!r}")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        int_field("logprobs", logprobs, 0, MAX_LOGPROBS)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest(f"echo: must be a boolean, got {echo!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream: must be a boolean, got {stream!r}")
    if stream and logprobs is not None:
        raise BadRequest("logprobs: not available when streaming (ask without stream)")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest(f"stream_options: only {{\"include_usage\": bool}} is supported, got {options!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2 ** 62):
        raise BadRequest(f"seed: must be an integer in [0, 2^62), got {seed!r}")
    for i, ids in enumerate(prompts):
        if not ids and max_tokens > 0:
            prompts[i] = ids = [tokenizer.eod]  # an empty prompt starts at <|endoftext|>
        if not ids:
            raise BadRequest(f"prompt: prompt {i} is empty and max_tokens is 0: nothing to score")
        if len(ids) + max_tokens > window:
            raise BadRequest(f"prompt: prompt {i} has {len(ids)} tokens and max_tokens is {max_tokens}: "
                             f"{len(ids) + max_tokens} exceeds the model's context of {window} tokens")
    base = secrets.randbits(61) if seed is None else seed
    params = [SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                             top_p=0.0 if top_p == 1.0 else float(top_p), seed=base + c, stop_ids=(tokenizer.eod,))
              for _ in prompts for c in range(n)]
    return CompletionRequest(prompts=[p for p in prompts for _ in range(n)], params=params, n=n, stops=stops,
                             logprobs=logprobs, echo=echo, stream=stream,
                             include_usage=bool(options.get("include_usage")), model=model)


def _prompts(prompt, tokenizer) -> list[list[int]]:
    def ids(p, where):
        if isinstance(p, str):
            return tokenizer.encode(p)
        if isinstance(p, list) and all(_is_int(t) for t in p):
            if any(not 0 <= t < tokenizer.vocab_size for t in p):
                raise BadRequest(f"prompt: {where} has a token id outside [0, {tokenizer.vocab_size})")
            return list(p)
        raise BadRequest(f"prompt: {where} must be a string or a list of token ids")

    if prompt is None:
        raise BadRequest("prompt: required")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        return [ids(prompt, "the prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt: must be a string, a list of token ids, or a non-empty list of either")
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"prompt: {len(prompt)} prompts given, at most {MAX_PROMPTS}")
    return [ids(p, f"prompt {i}") for i, p in enumerate(prompt)]


def find_stop(text: str, stops: list[str]) -> int:
    """Index of the first stop string in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters might begin a stop string (not streamed yet)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep


def completion_text(g: Generation, tokenizer, stops: list[str]) -> tuple[str, list[int], str]:
    """The completion's text, its tokens and finish reason: cut at eod and at the first stop string."""
    tokens = g.generated
    reason = g.finish_reason
    if tokens and tokens[-1] == tokenizer.eod and reason == "stop":
        tokens = tokens[:-1]
    text = tokenizer.decode(tokens)
    cut = find_stop(text, stops)
    if cut >= 0:
        text, reason = text[:cut], "stop"
        # the tokens whose text lies before the stop string
        kept = []
        for t in tokens:
            if len(tokenizer.decode(kept + [t])) > cut:
                break
            kept.append(t)
        tokens = kept
    return text, tokens, reason


def logprobs_block(g: Generation, tokens_from: int, upto: int, tokenizer, top_n: int) -> dict:
    """OpenAI's logprobs object for positions [tokens_from, upto) of ``g``."""
    ids = g.tokens[tokens_from:upto]
    texts = tokenizer.token_texts(ids)
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    tops = g.top_logprobs[tokens_from:upto]
    return {"tokens": texts, "token_logprobs": g.logprobs[tokens_from:upto],
            "top_logprobs": [None if d is None or not top_n else
                             {tokenizer.decode([k]): v for k, v in list(d.items())[:top_n]} for d in tops],
            "text_offset": offsets}


def response(req: CompletionRequest, results: list[Generation], tokenizer) -> dict:
    choices, completion_tokens = [], 0
    for index, g in enumerate(results):
        text, tokens, reason = completion_text(g, tokenizer, req.stops)
        completion_tokens += len(tokens)
        prompt_text = tokenizer.decode(g.tokens[: g.prompt_length]) if req.echo else ""
        choice = {"index": index, "text": prompt_text + text, "logprobs": None, "finish_reason": reason}
        if req.logprobs is not None:
            start = 0 if req.echo else g.prompt_length
            choice["logprobs"] = logprobs_block(g, start, g.prompt_length + len(tokens), tokenizer, req.logprobs)
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in req.prompts[:: req.n])
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chunk(req: CompletionRequest, cid: str, index: int, text: str, reason: str | None,
          logprobs: dict | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
