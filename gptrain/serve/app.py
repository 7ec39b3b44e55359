"""The HTTP application (FastAPI): Megatron's ``PUT /api``, OpenAI's ``/v1/completions`` (with
server-sent events), ``/v1/models``, ``/health``, the tokenizer endpoints lm-evaluation-harness's
remote tokenizer uses, and the web page at ``/``. Every error is ``{"error": ...}``: 400 for a bad
field, 413 for a body over the limit, 503 when the queue is full."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from gptrain.serve import megatron_api, openai_api
from gptrain.serve.engine import Engine, Job, QueueFull
from gptrain.serve.megatron_api import BadRequest


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Request, limit: int):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _TooLarge(int(length))
    raw = b""
    async for piece in request.stream():
        raw += piece
        if len(raw) > limit:
            raise _TooLarge(len(raw))
    try:
        return json.loads(raw or b"null")
    except ValueError as err:
        raise BadRequest(f"body: not valid JSON ({err})") from None


class _TooLarge(Exception):
    pass


def build_app(engine: Engine, model_name: str, max_body_bytes: int = 1 << 20, log=print) -> FastAPI:
    from gptrain.serve.page import PAGE

    app = FastAPI(title="gptrain text generation server", version="1")
    tok = engine.tokenizer
    window = engine.window

    async def run(job: Job):
        return await asyncio.wrap_future(engine.submit(job))

    def guarded(handler):
        async def wrapper(request: Request):
            try:
                body = await _json_body(request, max_body_bytes)
                return await handler(body)
            except BadRequest as err:
                return _error(400, str(err))
            except _TooLarge as err:
                return _error(413, f"body: {err.args[0]} bytes exceeds the limit of {max_body_bytes}")
            except QueueFull as err:
                return _error(503, str(err))
        wrapper.__name__ = handler.__name__
        return wrapper

    async def megatron(body):
        job, no_log = megatron_api.parse_request(body, tok, window)
        start = time.perf_counter()
        results = await run(job)
        if not no_log:
            log(f"PUT /api: {len(job.prompts)} prompts, {sum(len(g.generated) for g in results)} tokens generated "
                f"in {time.perf_counter() - start:.2f} s")
        return megatron_api.response(results, tok, job.logprobs)

    async def completions(body):
        req = openai_api.parse_request(body, tok, window, model_name)
        job = Job(prompts=req.prompts, params=req.params, logprobs=req.logprobs is not None,
                  top_logprobs=req.logprobs or 0)
        if not req.stream:
            return openai_api.response(req, await run(job), tok)
        return _stream(req, job)

    def _stream(req, job: Job) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cid = f"cmpl-{uuid.uuid4().hex}"
        rows = [{"tokens": [], "sent": 0, "done": False} for _ in req.prompts]
        cancelled = [False]

        def on_token(row: int, token: int):  # on the engine's thread
            if cancelled[0]:
                return True
            state = rows[row]
            if token == tok.eod:
                return None
            state["tokens"].append(token)
            text = tok.decode(state["tokens"])
            cut = openai_api.find_stop(text, req.stops)
            if cut >= 0:
                text, state["done"] = text[:cut], True
                safe = len(text)
            elif text.endswith("\ufffd"):
                return None
            else:
                safe = len(text) - openai_api.held_back(text, req.stops)
            if safe > state["sent"]:
                delta, state["sent"] = text[state["sent"]:safe], safe
                loop.call_soon_threadsafe(events.put_nowait, openai_api.chunk(req, cid, row, delta, None))
            return state["done"] or None

        job.on_token = on_token
        future = engine.submit(job)  # QueueFull is raised here, before the stream starts
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, None))

        async def body():
            try:
                if req.echo:
                    for i, p in enumerate(req.prompts):
                        yield _sse(openai_api.chunk(req, cid, i, tok.decode(p), None))
                while True:
                    event = await events.get()
                    if event is None:
                        break
                    yield _sse(event)
                if future.exception() is not None:
                    yield _sse({"error": f"generation failed: {future.exception()}"})
                    return
                results = future.result()
                completion_tokens = 0
                for i, g in enumerate(results):
                    text, tokens, reason = openai_api.completion_text(g, tok, req.stops)
                    completion_tokens += len(tokens)
                    rest = text[rows[i]["sent"]:]
                    yield _sse(openai_api.chunk(req, cid, i, rest, reason))
                if req.include_usage:
                    prompt_tokens = sum(len(p) for p in req.prompts[:: req.n])
                    yield _sse({"id": cid, "object": "text_completion", "created": int(time.time()),
                                "model": req.model, "choices": [],
                                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}})
                yield "data: [DONE]\n\n"
            finally:
                cancelled[0] = True  # a client that went away ends its rows at the next token

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def tokenize(body):
        if not isinstance(body, dict) or set(body) - {"prompt", "add_special_tokens", "model"}:
            raise BadRequest("body: expected {\"prompt\": str, \"add_special_tokens\": bool}")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt: must be a string, got {prompt!r}")
        if not isinstance(body.get("add_special_tokens", False), bool):
            raise BadRequest("add_special_tokens: must be a boolean")
        ids = tok.encode(prompt, allow_special=True)
        return {"tokens": ids, "count": len(ids), "max_model_len": window}

    async def detokenize(body):
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < tok.vocab_size for t in ids):
            raise BadRequest(f"tokens: must be a list of token ids in [0, {tok.vocab_size})")
        return {"prompt": tok.decode(ids)}

    app.add_api_route("/api", guarded(megatron), methods=["PUT"], summary="Megatron-LM's text generation API")
    app.add_api_route("/v1/completions", guarded(completions), methods=["POST"], summary="OpenAI completions")
    app.add_api_route("/tokenize", guarded(tokenize), methods=["POST"], summary="text -> token ids")
    app.add_api_route("/detokenize", guarded(detokenize), methods=["POST"], summary="token ids -> text")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "gptrain",
                                            "max_model_len": window}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "busy": engine.busy, "batches": engine.batches}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "pad_token": None,
                "tokenizer_class": "GPT2BPETokenizer", "vocab_size": tok.vocab_size, "model_max_length": window,
                "chat_template": None}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return PAGE.replace("{{MODEL}}", model_name)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
