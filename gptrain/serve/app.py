"""The HTTP application (FastAPI): Megatron's ``PUT /api``, OpenAI's ``/v1/completions`` (with
server-sent events), ``/v1/models``, ``/health``, the tokenizer endpoints lm-evaluation-harness's
remote tokenizer uses, and the web page at ``/``. Every error is ``{"error": ...}``: 400 for a bad
field (or JSON nested too deeply), 403 for a ``Host`` that is not this server's (guard.py), 413 for a
body over the limit or more rows than the queue can ever hold, 415 for a body that is not
``application/json``, 503 when the queue is full (retry later), 500 (one log line) when generation
fails, 504 when it runs past --request-timeout. A client that goes away while it waits ends its
generation (its rows stop at the next token).
``GET /metrics``: Prometheus text (metrics.py); each JSON endpoint counts its answers by outcome."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from gptrain.serve import megatron_api, openai_api
from gptrain.serve.engine import Engine, Job, QueueFull, Timeout, TooLarge
from gptrain.serve.guard import TOO_DEEP, HostGuard, Refused, error, json_body, own_names, require_json
from gptrain.serve.megatron_api import BadRequest

POLL_S = 0.2  # how often a waiting request checks that its client is still there


class _ClientGone(Exception):
    pass


class _Failed(Exception):
    pass


def build_app(engine: Engine, model_name: str, max_body_bytes: int = 1 << 20, log=print,
              host: str | None = None, allowed_hosts: list[str] | None = None) -> FastAPI:
    """``host``: the bind address; it, loopback names, IP addresses, this machine's name and
    ``allowed_hosts`` (``*``: any) are the ``Host`` headers served."""
    from gptrain.serve.page import PAGE

    app = FastAPI(title="gptrain text generation server", version="1")
    app.add_middleware(HostGuard, names=own_names(host, allowed_hosts))
    tok = engine.tokenizer
    window = engine.window
    metrics = engine.metrics

    async def run(job: Job, request: Request):
        """The job's results; while it waits, a client that went away cancels it."""
        future = asyncio.wrap_future(engine.submit(job))
        try:
            while not future.done():
                await asyncio.wait({future}, timeout=POLL_S)
                if not future.done() and await request.is_disconnected():
                    raise _ClientGone
        finally:
            if not future.done():
                job.cancel.set()  # dropped from the queue, or its rows end at their next token
        if isinstance(future.exception(), Timeout):
            raise future.exception()
        if future.exception() is not None:
            raise _Failed(f"{type(future.exception()).__name__}: {future.exception()}")
        return future.result()

    def guarded(endpoint: str, handler):
        async def wrapper(request: Request):
            response = await answer(request)
            if isinstance(response, dict):
                # the answers are plain JSON types already: FastAPI's jsonable_encoder would walk every
                # token id and log-probability of them again (the largest host cost of a request)
                response = JSONResponse(response)
            if not isinstance(response, StreamingResponse):  # a stream counts its outcome when it ends
                metrics.outcome(endpoint, getattr(response, "status_code", 200))
            return response

        async def answer(request: Request):
            try:
                require_json(request)
                body = await json_body(request, max_body_bytes)
                return await handler(body, request)
            except BadRequest as err:
                return error(400, str(err))
            except RecursionError:  # a value nested near Python's limit, shown in a message
                return error(400, TOO_DEEP)
            except Refused as err:
                return error(err.status, str(err))
            except TooLarge as err:
                return error(413, str(err))
            except QueueFull as err:
                return error(503, str(err), headers={"Retry-After": "1"})
            except Timeout as err:
                return error(504, str(err))
            except _ClientGone:
                log(f"{request.method} {request.url.path}: the client went away; its generation was stopped")
                return error(499, "the client went away")
            except _Failed as err:
                log(f"{request.method} {request.url.path}: generation failed: {err}")
                return error(500, f"generation failed: {err}")
            except Exception as err:  # noqa: BLE001 - one line, not a traceback per request
                log(f"{request.method} {request.url.path}: error: {type(err).__name__}: {err}")
                return error(500, f"{type(err).__name__}: {err}")
        wrapper.__name__ = handler.__name__
        return wrapper

    async def megatron(body, request):
        job, no_log = megatron_api.parse_request(body, tok, window)
        start = time.perf_counter()
        results = await run(job, request)
        if not no_log:
            log(f"PUT /api: {len(job.prompts)} prompts, {sum(len(g.generated) for g in results)} tokens generated "
                f"in {time.perf_counter() - start:.2f} s")
        return megatron_api.response(results, tok, job.logprobs)

    async def completions(body, request):
        req = openai_api.parse_request(body, tok, window, model_name)
        job = Job(prompts=req.prompts, params=req.params, logprobs=req.logprobs is not None,
                  top_logprobs=req.logprobs or 0)
        if not req.stream:
            return openai_api.response(req, await run(job, request), tok)
        return _stream(req, job)

    def _stream(req, job: Job) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cid = f"cmpl-{uuid.uuid4().hex}"
        rows = [{"tokens": [], "sent": 0, "done": False} for _ in req.prompts]
        outcome = {"status": 499}  # until the stream ends as it should (a client that went away)

        def on_token(row: int, token: int):  # on the engine's thread
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
                if isinstance(future.exception(), Timeout):
                    outcome["status"] = 504
                    yield _sse({"error": str(future.exception())})
                    return
                if future.exception() is not None:
                    outcome["status"] = 500
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
                outcome["status"] = 200
                yield "data: [DONE]\n\n"
            finally:
                metrics.outcome("/v1/completions", outcome["status"])
                job.cancel.set()  # a client that went away: dropped from the queue, or its rows end at the next token

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def tokenize(body, request):
        if not isinstance(body, dict) or set(body) - {"prompt", "add_special_tokens", "model"}:
            raise BadRequest("body: expected {\"prompt\": str, \"add_special_tokens\": bool}")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt: must be a string, got {prompt!r}")
        if not isinstance(body.get("add_special_tokens", False), bool):
            raise BadRequest("add_special_tokens: must be a boolean")
        ids = tok.encode(prompt, allow_special=True)
        return {"tokens": ids, "count": len(ids), "max_model_len": window}

    async def detokenize(body, request):
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < tok.vocab_size for t in ids):
            raise BadRequest(f"tokens: must be a list of token ids in [0, {tok.vocab_size})")
        return {"prompt": tok.decode(ids)}

    app.add_api_route("/api", guarded("/api", megatron), methods=["PUT"], summary="Megatron-LM's text generation API")
    app.add_api_route("/v1/completions", guarded("/v1/completions", completions), methods=["POST"],
                      summary="OpenAI completions")
    app.add_api_route("/tokenize", guarded("/tokenize", tokenize), methods=["POST"], summary="text -> token ids")
    app.add_api_route("/detokenize", guarded("/detokenize", detokenize), methods=["POST"],
                      summary="token ids -> text")

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics (text format)")
    async def prometheus():
        text, kind = metrics.text()
        return Response(content=text, media_type=kind)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "gptrain",
                                            "max_model_len": window}]}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "model": model_name, "busy": engine.busy, "batches": engine.batches,
                             "warming": getattr(engine, "warming", 0)})

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
